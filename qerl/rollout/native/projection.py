"""One GEMM over a group of the policy's sibling Linears (q/k/v, gate/up, or one alone), with their LoRA adapters.

Building a Projection is where the native engine changes the policy, and the only place: `fuse_as_views` lays a
group's frozen tensors out in one buffer and makes the policy's own tensors views of it. Values, shapes, dtypes and
the policy's forward stay as they were; the memory is the same bytes, now one buffer that one GEMM reads. Nothing
else of the policy is written: the adapters are copied into the Projection's own buffers at every `refresh()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qerl.nvfp4.linear import NVFP4Linear
from qerl.nvfp4.ops import nvfp4_linear, nvfp4_linear_lora, splitk_counters
from qerl.rollout.base import Unsupported
from qerl.sharding import whole


def base_layer(module: nn.Module) -> nn.Module:
    return getattr(module, "base_layer", module)


def active_lora(module: nn.Module) -> tuple[nn.Module, nn.Module, float] | None:
    """(A, B, scaling) of a peft LoRA Linear's active adapter, or None: A and B are the Linears whose weights are
    [r, K] and [N, r] (modules, whose parameters a sharding engine may replace; read their weight when needed)."""
    if not hasattr(module, "lora_A") or getattr(module, "disable_adapters", False):
        return None
    if getattr(module, "merged", False):
        raise Unsupported("merged LoRA adapters are not supported (the base would be changed)")
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) > 1:
        raise Unsupported(f"{len(active)} active LoRA adapters; one is supported")
    if not active:
        return None
    name = active[0]
    if getattr(module, "use_dora", {}).get(name, False):
        raise Unsupported("DoRA adapters are not supported")
    return module.lora_A[name], module.lora_B[name], float(module.scaling[name])


def fuse_as_views(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The policy's tensors of one group concatenated along dim 0 into one buffer, each of them rebound (`.data`)
    to its slice of it: the modules keep their tensors (same values and shapes), the originals' memory is freed,
    so the group costs no extra byte. A group of one is its own buffer, untouched. The one place where building
    the engine changes the policy (this module's docstring)."""
    if len(tensors) == 1:
        return tensors[0].detach()
    fused = torch.cat([t.detach() for t in tensors])
    offset = 0
    for t in tensors:
        t.data = fused[offset : offset + t.shape[0]]
        offset += t.shape[0]
    return fused


class Projection:
    """One GEMM over a group of sibling Linears (q/k/v, gate/up, or one alone) of the frozen base, plus their
    LoRA adapters as two small GEMMs."""

    def __init__(
        self, modules: list[nn.Module], device: torch.device, dtype: torch.dtype, gather_each_round: bool = False
    ):
        bases = [base_layer(m) for m in modules]
        self.modules = modules
        self.dtype = dtype
        self.nvfp4 = isinstance(bases[0], NVFP4Linear)
        if any(isinstance(b, NVFP4Linear) != self.nvfp4 for b in bases):
            raise Unsupported("a fused group mixes NVFP4 and BF16 layers")
        self.out_features = sum(b.out_features for b in bases)
        biases = [b.bias for b in bases]
        if any((t is None) != (biases[0] is None) for t in biases):
            raise Unsupported("a fused group mixes layers with and without bias")
        if self.nvfp4:
            scales = [b.weight_global_scale for b in bases]
            if any(not torch.equal(s, scales[0]) for s in scales):
                # Fusion needs one global scale per group (our quantizer and llmcompressor share it).
                raise Unsupported("q/k/v (or gate/up) NVFP4 weights have different global scales")
            self.packed = fuse_as_views([b.weight_packed for b in bases])
            self.scale = fuse_as_views([b.weight_scale for b in bases])
            self.global_scale = scales[0]
        elif gather_each_round:
            raise Unsupported(
                "the BF16 base's weights are sharded (FSDP2 / ZeRO-3); the engine runs "
                "on whole weights, which only an NVFP4 base keeps on every rank (as buffers)"
            )
        else:
            self.weight = fuse_as_views([b.weight for b in bases])
        self.bias = None
        self._bias_owners = bases if biases[0] is not None and gather_each_round else None  # read every round
        if biases[0] is not None and not gather_each_round:
            self.bias = fuse_as_views(biases).to(dtype)  # a copy only if the bias is not in the activations' dtype
        loras = [active_lora(m) for m in modules]
        self.lora_a = self.lora_b = None
        if any(lora is not None for lora in loras):
            # Padded with zeros to a power of two >= 16: the ranks the NVFP4 GEMM's LoRA programs work on.
            rank = max(16, 1 << (sum(lora[0].out_features for lora in loras if lora is not None) - 1).bit_length())
            in_features = bases[0].in_features
            self.lora_a = torch.zeros((rank, in_features), dtype=dtype, device=device)
            self.lora_b = torch.zeros((self.out_features, rank), dtype=dtype, device=device)
        if self.nvfp4:
            lora_rank = 0 if self.lora_a is None else self.lora_a.shape[0]
            self.counters = splitk_counters(self.out_features, device, lora_rank)
        self._loras = loras

    @torch.no_grad()
    def refresh(self) -> None:
        """Write the adapters' current values (BF16, scaling folded into B) into the fixed buffers; gather the
        biases of a sharded policy."""
        if self._bias_owners is not None:
            self.bias = torch.cat([whole(b.bias) for b in self._bias_owners]).to(self.dtype)
        if self.lora_a is None:
            return
        r0 = n0 = 0
        for module, lora in zip(self.modules, self._loras, strict=True):
            n = base_layer(module).out_features
            if lora is not None:
                a, b, scaling = whole(lora[0].weight), whole(lora[1].weight), lora[2]
                r = a.shape[0]
                self.lora_a[r0 : r0 + r].copy_(a)
                self.lora_b[n0 : n0 + n, r0 : r0 + r].copy_(b).mul_(scaling)
                r0 += r
            n0 += n

    def release(self) -> None:
        """Drop the biases a sharded policy's round gathered."""
        if self._bias_owners is not None:
            self.bias = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.nvfp4:
            args = (x, self.packed, self.scale, self.global_scale, self.bias, self.counters)
            if self.lora_a is None:
                return nvfp4_linear(*args)
            return nvfp4_linear_lora(*args, self.lora_a, self.lora_b)  # the adapter in the same launch
        y = F.linear(x, self.weight, self.bias)
        return y if self.lora_a is None else y.addmm_(x @ self.lora_a.t(), self.lora_b.t())
