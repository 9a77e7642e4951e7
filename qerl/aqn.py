"""Adaptive Quantization Noise (AQN): a decaying Gaussian perturbation of the rollout policy's RMSNorm scales.

QeRL (paper Eq. 10) samples rollouts from RMSNorm_noise(x) = (w + Z) * x / rms(x), Z ~ N(0, sigma_k^2), with a
fresh Z every generation round, so that the q/k/v projections share one noise vector (input_layernorm) and
gate/up another (post_attention_layernorm). The training forward sees the clean scales.

This module knows nothing about trainers: it gives the schedule, finds the norms of any model, and perturbs
them inside a context manager that restores the exact clean values on exit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

# ----------------------------------------------------------------------------------------------------------
# Schedule


def sigma_trend(sigma_start: float, sigma_end: float, num_stages: int) -> list[float]:
    """The K-1 noise levels of stages 1..K-1: geometric from sigma_start to sigma_end (reference formula)."""
    if num_stages < 3:
        raise ValueError(f"AQN needs num_stages >= 3 (one noise-free stage and two noise levels), got {num_stages}")
    if sigma_start <= 0 or sigma_end <= 0:
        raise ValueError(f"AQN sigmas must be positive, got sigma_start={sigma_start}, sigma_end={sigma_end}")
    ratio = sigma_end / sigma_start
    return [sigma_start * ratio ** (i / (num_stages - 2)) for i in range(num_stages - 1)]


def sigma_at(step: int, total_steps: int, sigma_start: float, sigma_end: float, num_stages: int) -> float:
    """sigma for the generation of optimizer step `step` (0-based) of `total_steps`.

    The run is cut into num_stages equal intervals; the first is noise-free, interval i >= 1 uses
    sigma_trend[i - 1]; steps at or beyond the end stay on the last level. Same arithmetic as the reference
    (`get_sigma_by_step`), evaluated where the reference does: its counter (`update_step`) is advanced before
    each step's generation, so step k samples with the counter at k + 1.
    """
    trend = sigma_trend(sigma_start, sigma_end, num_stages)
    if total_steps <= 0:
        raise ValueError(f"AQN needs the total number of training steps, got {total_steps}")
    counter = min(step + 1, total_steps)
    steps_per_interval = total_steps / (len(trend) + 1)
    interval = int(counter // steps_per_interval)
    if interval == 0:
        return 0.0
    return trend[min(interval - 1, len(trend) - 1)]


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

    def select(self, include_final: bool) -> dict[str, nn.Module]:
        return {**self.layer_norms, **(self.final_norms if include_final else {})}


def _hidden_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "hidden_size", None)


def find_norms(model: nn.Module, hidden_size: int | None = None) -> NormSites:
    """Every hidden-size RMSNorm of `model`, split into per-layer norms and final norms.

    A norm is a per-layer norm when it sits inside an element of an nn.ModuleList (the decoder layer stack, in
    transformers, vLLM or any other model); hidden-size norms elsewhere are final norms. Per-head norms (Qwen3's
    q_norm/k_norm) are excluded by the size check.
    """
    hidden_size = hidden_size or _hidden_size(model)
    sites = NormSites()

    def visit(module: nn.Module, path: str, in_layer: bool):
        active = _active_copy(module)
        if active is not None:
            name, module = active
            path = f"{path}.{name}" if path else name
        if is_rmsnorm(module, hidden_size):
            (sites.layer_norms if in_layer else sites.final_norms)[path] = module
            return
        for child_name, child in module.named_children():
            child_path = f"{path}.{child_name}" if path else child_name
            visit(child, child_path, in_layer or isinstance(module, nn.ModuleList))

    visit(model, "", False)
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


# ----------------------------------------------------------------------------------------------------------
# Applying the noise

# How the noise meets the scale. "fp32": added in FP32 to an FP32 copy of the scale, so that every level of the
# schedule survives (Eq. 10: w + Z). "bf16": the reference's: the noise is cast to the BF16 scale's dtype and
# added there, so noise below half a BF16 ulp of the scale rounds away (on scales near 1: sigma 1e-3 moves ~3%
# of the entries, 1e-4 none).
DTYPE_RULES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class NoiseStats:
    sigma: float = 0.0
    num_norms: int = 0
    num_elements: int = 0
    changed_fraction: float = 0.0  # share of scale entries that the noise moved in the rule's dtype


@contextlib.contextmanager
def noisy_norms(
    model: nn.Module,
    sigma: float,
    generator: torch.Generator | None = None,
    include_final: bool = False,
    sites: NormSites | None = None,
    dtype_rule: str = "fp32",
    fp32_compute: bool = True,
):
    """Add fresh N(0, sigma^2) noise to the model's RMSNorm scales for the duration of the block.

    The noise is drawn in float32 on the CPU, norm after norm in module order (reproducible on any device, rank
    and backend for a given generator), then meets each scale in the dtype of `dtype_rule` (see DTYPE_RULES).
    A scale stored in that dtype or in FP32 is perturbed in place (engines that captured its address, as CUDA
    graphs do, see the noise); a BF16 scale under the fp32 rule gets a perturbed FP32 Parameter for the duration,
    and the original Parameter object back on exit. Either way the clean scales come back bit for bit:
    subtracting the noise would not undo the rounding.
    With the fp32 rule and `fp32_compute`, the perturbed norms also run in FP32 (FP32Compute) so that the noise
    survives until their output is rounded once; engines whose norms take an FP32 scale themselves (or whose
    forward runs in CUDA graphs, where hooks do not run) pass False. Yields NoiseStats.
    """
    if dtype_rule not in DTYPE_RULES:
        raise ValueError(f"unknown AQN dtype rule {dtype_rule!r}; known: {', '.join(DTYPE_RULES)}")
    stats = NoiseStats(sigma=float(sigma))
    if sigma <= 0:
        yield stats
        return
    dtype = DTYPE_RULES[dtype_rule]
    norms = (sites or find_norms(model)).select(include_final)
    undo = []
    changed = 0
    try:
        with torch.no_grad():
            for module in norms.values():
                weight = module.weight
                noise = torch.randn(weight.shape, generator=generator, dtype=torch.float32) * sigma
                noise = noise.to(device=weight.device, dtype=dtype)
                clean = weight.detach().to(dtype)
                noisy = clean + noise
                changed += int((noisy != clean).sum())
                if weight.dtype in (dtype, torch.float32):  # FP32 holds every BF16 value
                    saved = weight.detach().clone()
                    undo.append(lambda weight=weight, saved=saved: weight.copy_(saved))
                    weight.copy_(noisy)
                else:
                    undo.append(lambda module=module, weight=weight: module._parameters.__setitem__("weight", weight))
                    module._parameters["weight"] = nn.Parameter(noisy, requires_grad=False)
                stats.num_elements += weight.numel()
                if dtype_rule == "fp32" and fp32_compute and not computes_in_fp32(module):
                    undo.append(FP32Compute(module).remove)
        stats.num_norms = len(norms)
        stats.changed_fraction = changed / max(stats.num_elements, 1)
        yield stats
    finally:
        with torch.no_grad():
            for step in reversed(undo):
                step()
