"""Which Linears of a model become NVFP4, and which of them share a global scale.

llmcompressor's NVFP4A16 recipe quantizes every nn.Linear except those it is told to ignore (lm_head),
and takes one amax over each fused group, q/k/v and gate/up of one layer, so that their global scales
are equal and a kernel (or vLLM) can run the group as one GEMM. The same rules serve in-memory
quantization here and the streaming checkpoint quantizer in quantize_checkpoint.py.
"""

from __future__ import annotations

import torch
from torch import nn

from qerl.nvfp4 import DEFAULT_IGNORE, codec
from qerl.nvfp4.linear import NVFP4Linear

# Sibling Linears of one layer whose weights share one global scale (llmcompressor's fused groups).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def is_ignored(module_name: str, ignore=DEFAULT_IGNORE) -> bool:
    return any(module_name == pattern or module_name.endswith("." + pattern) for pattern in ignore)


def quantization_targets(model: nn.Module, ignore=DEFAULT_IGNORE) -> list[str]:
    """Names of the plain nn.Linear modules that NVFP4A16 quantizes."""
    return [
        name for name, module in model.named_modules() if type(module) is nn.Linear and not is_ignored(name, ignore)
    ]


def fused_siblings(module_name: str) -> tuple[str, ...]:
    """Full names of the modules sharing `module_name`'s global scale (itself alone if not fused)."""
    parent, _, leaf = module_name.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            return tuple(f"{parent}.{member}" if parent else member for member in group)
    return (module_name,)


def fused_groups(names) -> list[tuple[str, ...]]:
    """`names` (module names) grouped as they share a global scale (fused_siblings among `names`), in the order
    each group first appears."""
    present = dict.fromkeys(names)  # in order, with set lookups
    groups = {}
    for name in present:
        groups.setdefault(tuple(m for m in fused_siblings(name) if m in present), None)
    return list(groups)


def global_scales(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Global scale of each weight (keyed by module name), fused groups sharing one.

    A fused group member whose siblings are absent from `weights` (another architecture, a model with
    pre-fused qkv) gets a scale of its own, which is what llmcompressor does too.
    """
    scales: dict[str, torch.Tensor] = {}
    for name in weights:
        if name in scales:
            continue
        members = [m for m in fused_siblings(name) if m in weights] or [name]
        scale = codec.compute_global_scale(*(weights[m] for m in members))
        for member in members:
            scales[member] = scale
    return scales


@torch.no_grad()
def quantize_model(model: nn.Module, ignore=DEFAULT_IGNORE) -> nn.Module:
    """Replace, in place, every targeted nn.Linear with an NVFP4Linear; returns the model."""
    targets = quantization_targets(model, ignore)
    modules = dict(model.named_modules())
    scales = global_scales({name: modules[name].weight for name in targets})
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, child, NVFP4Linear.from_linear(modules[name], scales[name], name=f"{name}.weight"))
    return model
