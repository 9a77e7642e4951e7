"""The frozen base of a policy: an NVFP4 (or BF16) checkpoint loaded as a model, its tokenizer, and what the rest of
qerl asks of it (is it NVFP4, its decoder layers, whether its EOS ids agree with the tokenizer's).

One road leads from a checkpoint to a trainable policy, in training and in the tests alike:
    load_base_model(folder)      NVFP4A16 folder -> NVFP4Linear layers (qerl.nvfp4.checkpoint); else transformers
    QeRLTrainer(base, ...)       lora.lora_config(...) -> TRL's get_peft_model -> lora.keep_fp32_masters(...)
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from qerl.field_rules import PRECISIONS
from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint, load_nvfp4_model
from qerl.nvfp4.linear import NVFP4Linear


def is_nvfp4_model(model: nn.Module) -> bool:
    return any(isinstance(m, NVFP4Linear) for m in model.modules())


def load_base_model(
    name_or_path: str | os.PathLike,
    precision: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> nn.Module:
    """The frozen base: NVFP4 checkpoint -> NVFP4Linear layers; BF16 checkpoint -> plain transformers model.

    precision "auto" reads the checkpoint's config; "nvfp4" insists (and fails clearly on a BF16 folder).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if precision == "auto":
        precision = "nvfp4" if is_nvfp4_checkpoint(name_or_path) else "bf16"
    if precision == "nvfp4":
        model = load_nvfp4_model(name_or_path, device=device, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        if is_nvfp4_checkpoint(name_or_path):
            raise ValueError(f"{name_or_path} is a quantized checkpoint; load it with precision 'nvfp4' or 'auto'")
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype).to(device)
    model.requires_grad_(False)
    return model


def load_tokenizer(name_or_path: str | os.PathLike):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # transformers 5.17's AutoTokenizer swaps a generic tokenizers-backed tokenizer for the model type's class
    # (Qwen2Tokenizer rebuilds its own pre-tokenizer, dropping whitespace of a character-level vocab): a folder
    # that declares the generic class gets exactly what its tokenizer.json says.
    config_path = os.path.join(name_or_path, "tokenizer_config.json")
    declared = None
    if os.path.isfile(config_path):
        with open(config_path) as f:
            declared = json.load(f).get("tokenizer_class")
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(name_or_path, padding_side="left")
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_mismatch(tokenizer, generation_config) -> str | None:
    """When the tokenizer's EOS is not one of the generation config's EOS ids (a GGUF's tokenizer metadata, or
    another model's tokenizer files), a warning naming both; else None."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if not ids or tokenizer.eos_token_id in ids:
        return None
    named = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} (id {i})" for i in ids)
    return (
        f"the tokenizer's EOS {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) is not among the generation "
        f"config's EOS ids: {named}"
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (model.model.layers), peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers
