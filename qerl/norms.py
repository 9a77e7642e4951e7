"""The RMSNorms of a model: finding them by what they are, and running one in FP32.

AQN perturbs these scales (qerl.aqn) and `ln` trains them (qerl.lora); both need the same answer to "which
modules are the per-layer RMSNorms", in a transformers model, a peft-wrapped one or a rollout engine's own.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

# ----------------------------------------------------------------------------------------------------------
# Finding the norms


def _norm_eps(module: nn.Module, dtype: torch.dtype) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        if name in module.__dict__:
            value = module.__dict__[name]
            if value is None:  # torch.nn.RMSNorm: eps=None means the dtype's machine epsilon
                return torch.finfo(dtype).eps
            if isinstance(value, (int, float)):
                return float(value)
    return None


@torch.no_grad()
def _behaves_as_rmsnorm(module: nn.Module, weight: torch.Tensor, eps: float) -> bool:
    """Probe the forward: x / rms(x) scaled by w (Llama/Qwen style) or by 1 + w (Gemma style)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, weight.numel(), generator=gen) * 3 + 1).to(weight.device, weight.dtype)
    try:
        y = module(x)
    except Exception:  # not callable on a plain tensor: not a norm we know how to perturb
        return False
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return False
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    tol = 1e-5 if weight.dtype == torch.float32 else 5e-2
    return any(torch.allclose(y.float(), normed * scale, rtol=tol, atol=tol) for scale in (w, 1 + w))


def is_rmsnorm(module: nn.Module, hidden_size: int | None = None) -> bool:
    """Whether `module` is an RMSNorm, whatever library defined it.

    An RMSNorm here is a module with a 1-D `weight` (of size hidden_size when given), an epsilon attribute, no
    bias, and either "RMSNorm" in its class name or a forward that computes w * x / rms(x) (or (1 + w) * ...).
    The probe catches norms whose class is called something else; the bias and behaviour checks keep
    LayerNorm out.
    """
    weight = module.__dict__.get("_parameters", {}).get("weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.numel() == 0:
        return False
    if hidden_size is not None and weight.numel() != hidden_size:
        return False
    if module.__dict__.get("_parameters", {}).get("bias") is not None:
        return False
    eps = _norm_eps(module, weight.dtype)
    if eps is None:
        return False
    if "rmsnorm" in type(module).__name__.lower():
        return True
    return _behaves_as_rmsnorm(module, weight, eps)


def _active_copy(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(relative path, module) of the copy that runs inside a peft modules_to_save wrapper, else None.

    peft's wrapper (trainable norms) keeps the frozen original and one trainable copy per adapter and
    forwards through the active adapter's copy; noise must go there, or the rollout would not see it.
    """
    copies = module._modules.get("modules_to_save")
    if not isinstance(copies, nn.ModuleDict) or "original_module" not in module._modules:
        return None
    active = list(getattr(module, "active_adapters", []) or [])
    if getattr(module, "disable_adapters", False) or not active or active[0] not in copies:
        return "original_module", module._modules["original_module"]
    return f"modules_to_save.{active[0]}", copies[active[0]]


@dataclass
class NormSites:
    """The RMSNorms AQN perturbs, by role. Names are module paths (the active copy's path under peft)."""

    layer_norms: dict[str, nn.Module] = field(default_factory=dict)  # norms inside decoder layers
    final_norms: dict[str, nn.Module] = field(default_factory=dict)  # hidden-size norms outside them
    head_norms: dict[str, nn.Module] = field(default_factory=dict)  # per-head norms inside layers (Qwen3's q/k_norm)
    layer_of: dict[str, str] = field(default_factory=dict)  # a layer or head norm's path -> its layer's index

    def select(self, include_final: bool, include_heads: bool = False) -> dict[str, nn.Module]:
        """The norms to perturb, by module path: the layer norms, then the final and per-head norms if asked."""
        return {
            **self.layer_norms,
            **(self.final_norms if include_final else {}),
            **(self.head_norms if include_heads else {}),
        }

    def keyed(self, include_final: bool, include_heads: bool = False) -> dict[str, nn.Module]:
        """The same norms by noise key (`noise_keys`): the name AQN draws each norm's noise under."""
        selected = self.select(include_final, include_heads)
        keys = noise_keys({path: self.layer_of.get(path) for path in selected})
        return {keys[path]: module for path, module in selected.items()}


# A peft modules_to_save wrapper's suffix on the path of the copy that runs (find_norms' _active_copy).
_WRAPPED = re.compile(r"\.(?:modules_to_save\.[^.]+|original_module)$")


def noise_keys(layer_of: dict[str, str | None]) -> dict[str, str]:
    """path -> the name a norm's AQN noise is drawn under, from each norm's path and its layer's index (the element
    of the outermost ModuleList it sits in; None outside the layers): the index and the norm's own name
    ("3.input_layernorm", "3.q_norm"), "final.norm" outside the layers. The policy, peft's active copy, the native
    engine's NormScales and vLLM's model nest their norms differently ("layers.3.self_attn.q_norm",
    "layers.3.q_norm") but name them alike, so each norm gets the same noise on every backend whatever else their
    trees hold and in whatever order they list them. Norms whose short names coincide (two of one layer with the
    same name, two stacks of layers) are named by their whole paths instead, which a module tree keeps apart."""
    short = {}
    for path, layer in layer_of.items():
        name = _WRAPPED.sub("", path).rsplit(".", 1)[-1]
        short[path] = f"final.{name}" if layer is None else f"{layer}.{name}"
    counts = Counter(short.values())
    return {path: key if counts[key] == 1 else _WRAPPED.sub("", path) for path, key in short.items()}


def noise_seed(round_seed: int, key: str) -> int:
    """The seed of one norm's noise in one round: a digest of both (Python's str hash differs between processes)."""
    digest = hashlib.blake2b(f"{round_seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "hidden_size", None)


def find_norms(model: nn.Module, hidden_size: int | None = None) -> NormSites:
    """Every hidden-size RMSNorm of `model`, split into per-layer norms and final norms, and the other RMSNorms
    inside its layers (per-head norms: Qwen3's and Gemma-3's q_norm/k_norm) apart.

    A norm is a per-layer norm when it sits inside an element of an nn.ModuleList (the decoder layer stack, in
    transformers, vLLM or any other model); hidden-size norms elsewhere are final norms. Without a hidden size
    (given, or in the model's config) every RMSNorm counts as a hidden-size one.
    """
    hidden_size = hidden_size or _hidden_size(model)
    sites = NormSites()

    def visit(module: nn.Module, path: str, layer: str | None):
        active = _active_copy(module)
        if active is not None:
            name, module = active
            path = f"{path}.{name}" if path else name
        if is_rmsnorm(module, hidden_size):
            (sites.layer_norms if layer is not None else sites.final_norms)[path] = module
        elif layer is not None and is_rmsnorm(module):
            sites.head_norms[path] = module
        else:
            for child_name, child in module.named_children():
                child_path = f"{path}.{child_name}" if path else child_name
                inner = child_name if layer is None and isinstance(module, nn.ModuleList) else layer
                visit(child, child_path, inner)
            return
        if layer is not None:
            sites.layer_of[path] = layer

    visit(model, "", None)
    return sites


def layer_norm_names(model: nn.Module) -> list[str]:
    """Leaf names of the per-layer norms (e.g. input_layernorm, post_attention_layernorm), for peft's
    modules_to_save: found by what the modules are, then named the way peft matches them."""
    names = {path.split(".")[-1] for path in find_norms(model).layer_norms}
    return sorted(names)


# ----------------------------------------------------------------------------------------------------------
# Running a norm in FP32


class FP32Compute:
    """Runs a module in FP32 and hands its output back in its input's dtype, through forward hooks: floating
    inputs are upcast, floating outputs cast back to the dtype of the first floating input.

    A norm with an FP32 scale in a BF16 model then rounds once, (w * x / rms(x)) -> BF16, where transformers'
    RMSNorms round x / rms(x) to BF16 first and would then return FP32 (which a BF16 Linear refuses). Scale
    changes below BF16 resolution (an optimizer step, AQN noise) thus still reach the next layer's input as
    shifted roundings. `remove()` takes the hooks off again.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self._dtypes: list[torch.dtype | None] = []  # a stack: a module may be re-entered (checkpoint recompute)
        self._handles = [
            module.register_forward_pre_hook(self._upcast, with_kwargs=True),
            module.register_forward_hook(self._downcast, with_kwargs=True),
        ]
        module.qerl_fp32_compute = self

    @staticmethod
    def _to(value, dtype):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, tuple):
            return tuple(FP32Compute._to(v, dtype) for v in value)
        return value

    def _upcast(self, module, args, kwargs):
        first = next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()), None
        )
        self._dtypes.append(None if first is None else first.dtype)
        return self._to(args, torch.float32), {k: self._to(v, torch.float32) for k, v in kwargs.items()}

    def _downcast(self, module, args, kwargs, output):
        dtype = self._dtypes.pop()
        return output if dtype is None else self._to(output, dtype)

    def remove(self):
        for handle in self._handles:
            handle.remove()
        del self.module.qerl_fp32_compute


def computes_in_fp32(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("qerl_fp32_compute"), FP32Compute)
