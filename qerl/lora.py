"""The part of a policy that trains: LoRA adapters on the projections (peft), optionally the per-layer RMSNorm scales
(QeRL's `ln`), every trainable parameter kept as an FP32 master."""

from __future__ import annotations

import torch
from peft import LoraConfig
from torch import nn

from qerl import norms
from qerl.field_rules import LORA_TARGETS


def lora_config(
    model: nn.Module,
    rank: int = 16,
    alpha: int = 16,
    targets: tuple[str, ...] | list[str] = LORA_TARGETS,
    dropout: float = 0.0,
    trainable_norms: bool = False,
) -> LoraConfig:
    """LoRA on the projections; with trainable_norms, the per-layer RMSNorms (found by what they are) train in
    full through peft's modules_to_save, as QeRL's `ln` option does for input/post-attention norms."""
    modules_to_save = norms.layer_norm_names(model) if trainable_norms else None
    if trainable_norms and not modules_to_save:
        raise ValueError(f"trainable_norms: found no per-layer RMSNorm in {type(model).__name__}")
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets),
        modules_to_save=modules_to_save,
        bias="none",
        task_type="CAUSAL_LM",
    )


def keep_fp32_masters(model: nn.Module) -> list[str]:
    """Cast every trainable parameter that is not FP32 to FP32; returns their names.

    An AdamW step at the recipes' lr (1e-5) is below half a BF16 ulp of a scale near 1, so BF16 norm scales
    would never move; peft keeps LoRA in FP32 already (autocast_adapter_dtype), its modules_to_save copies not.
    The cast modules (other than LoRA's, which peft wraps in casts) run through norms.FP32Compute, so that a BF16
    model still hands BF16 activations to the next layer (the forward computes in BF16, the master is FP32).
    """
    cast = []
    for module_name, module in model.named_modules():
        owned = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        changed = False
        for name, param in owned:
            if param.dtype != torch.float32:
                param.data = param.data.float()
                cast.append(f"{module_name}.{name}")
                changed = True
        if changed and "lora_" not in module_name and not norms.computes_in_fp32(module):
            norms.FP32Compute(module)
    return cast
