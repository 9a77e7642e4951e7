"""NVFP4A16 weight codec, bit-exact with compressed-tensors' `nvfp4-pack-quantized` format.

Layout of one quantized Linear weight W [N, K] (see DESIGN.md):
  packed        uint8          [N, K/2]   two E2M1 codes per byte, even k in the low nibble
  scale         float8_e4m3fn  [N, K/16]  one scale per group of 16 along K
  global_scale  float32        [1]        448 * 6 / amax(|W|), shared by fused groups (q/k/v, gate/up)
  W ~= bf16(value(code) * (fp32(scale) / global_scale))

Every rounding step mirrors what llmcompressor's observers and compressed-tensors' compressor do, in the
same dtypes, so that the bytes match: the amaxes stay in the weight dtype, the group scale goes
weight dtype -> fp32 -> fp8, the division by the effective scale runs in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

GROUP_SIZE = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
# What compressed-tensors substitutes for an all-zero group's scale (the fp8 e4m3 epsilon).
ZERO_GROUP_SCALE = torch.finfo(torch.float8_e4m3fn).eps

# E2M1 magnitudes by 3-bit index; bit 3 of a code is the sign.
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
# Signed value of each of the 16 codes, for table-lookup decoding.
FP4_CODE_VALUES = torch.cat([FP4_VALUES, -FP4_VALUES])
# Upper bounds of the index buckets for |x| in [0, 6] (the midpoints of FP4_VALUES). A value on a bound rounds up,
# except on the bounds in _TIES_DOWN: ties go to the even mantissa (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
# 3.5->4, 5->4).
_BUCKET_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)


@dataclass(frozen=True)
class NVFP4Weight:
    """The three tensors that store one quantized weight, named as on disk (minus the `weight_` prefix)."""

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.packed, self.scale, self.global_scale, dtype)


def check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    """Raise a ValueError naming `name` if the weight cannot be stored as NVFP4."""
    if weight.ndim != 2:
        raise ValueError(f"{name}: NVFP4 quantizes 2-D Linear weights, got shape {tuple(weight.shape)}")
    if weight.shape[1] % GROUP_SIZE != 0:
        raise ValueError(f"{name}: in_features={weight.shape[1]} is not divisible by the NVFP4 group size {GROUP_SIZE}")
    if not weight.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {weight.dtype}")
    if not torch.isfinite(weight).all():
        bad = (~torch.isfinite(weight)).nonzero()[0].tolist()
        raise ValueError(f"{name}: contains NaN or Inf (first at index {bad}); refusing to quantize it")


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """448 * 6 / amax, computed in amax's dtype (bf16 for bf16 weights) as llmcompressor does, as fp32 [1]."""
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    gs = (FP8_MAX * FP4_MAX) / amax
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def compute_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """Global scale shared by `weights`: pass q, k, v (or gate, up) together to get the fused group's scale."""
    amax = torch.stack([w.detach().abs().amax() for w in weights]).amax()
    return global_scale_from_amax(amax)


def compute_group_scales(weight: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 scale of each group of 16: fp8(clamp(gs * (amax_g / 6), +-448)), 0 -> fp8 epsilon."""
    n, k = weight.shape
    amax_g = weight.detach().reshape(n, k // GROUP_SIZE, GROUP_SIZE).abs().amax(dim=-1)
    local = amax_g / torch.tensor(FP4_MAX, dtype=amax_g.dtype)  # stays in the weight dtype
    scale = (global_scale.to(torch.float32) * local).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    # Unconditionally, not under `if zero.any()`: that would wait for the GPU at every call (GPTQ makes one per
    # group of 16 columns). FP8 -> FP32 -> FP8 is exact, so the nonzero scales are unchanged.
    return torch.where(scale == 0, ZERO_GROUP_SCALE, scale).to(torch.float8_e4m3fn)


def round_to_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale) to 4-bit E2M1 codes, nearest-even, saturating at 6.

    The sign bit is set for x < 0, so a small negative value that rounds to zero is stored as -0 (code 8),
    as compressed-tensors does; an exact -0.0 input is stored as +0 there too.
    """
    magnitude_bounds, _, _ = _rounding_tables(x.device)
    index = torch.bucketize(x.abs(), magnitude_bounds, right=True)  # past the last bound: 7, i.e. 6 (saturated)
    return index.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)


def round_to_values(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 value round_to_codes(x) stands for (FP4_CODE_VALUES of it, up to the sign of a zero), in two
    kernels: GPTQ rounds one column at a time, and its speed is the host's rate of launching them."""
    _, signed_bounds, signed_values = _rounding_tables(x.device)
    return signed_values[torch.bucketize(x, signed_bounds, right=True)]


@functools.cache
def _rounding_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bucket bounds for one bucketize(right=True), made once per device (a copy from the host per call would wait
    for the GPU): over |x|, and over the signed line with the value of each bucket. A value on a bound goes to the
    bucket above it, so where a tie must go below (toward zero for x > 0, away from it for x < 0) the bound moves up
    by one FP32 step: the FP32 values on and next to it then land where ties-to-even puts them."""
    bounds = torch.tensor(_BUCKET_BOUNDS, dtype=torch.float32)
    ties_down = torch.isin(bounds, torch.tensor(_TIES_DOWN, dtype=torch.float32))
    up = torch.tensor(float("inf"))
    positive = torch.where(ties_down, torch.nextafter(bounds, up), bounds)
    negative = torch.where(ties_down, -bounds, torch.nextafter(-bounds, up)).flip(0)
    values = torch.cat([-FP4_VALUES[1:].flip(0), FP4_VALUES])
    return positive.to(device), torch.cat([negative, positive]).to(device), values.to(device)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 codes -> [N, K/2] bytes, even k in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] uint8 codes."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "weight") -> NVFP4Weight:
    """Quantize a [N, K] weight; pass the fused group's `global_scale` for q/k/v or gate/up members."""
    check_weight(weight, name)
    if global_scale is None:
        global_scale = compute_global_scale(weight)
    global_scale = global_scale.to(device=weight.device, dtype=torch.float32).reshape(1)
    scale = compute_group_scales(weight, global_scale)
    n, k = weight.shape
    effective = (scale.to(torch.float32) / global_scale).repeat_interleave(GROUP_SIZE, dim=1)
    codes = round_to_codes(weight.detach().to(torch.float32) / effective)
    return NVFP4Weight(pack_codes(codes), scale, global_scale)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """W = dtype(value(code) * (fp32(scale) / global_scale)), exactly as compressed-tensors decompresses."""
    values = FP4_CODE_VALUES.to(packed.device)[unpack_codes(packed).long()]
    effective = scale.to(torch.float32) / global_scale.to(torch.float32)
    return (values * effective.repeat_interleave(GROUP_SIZE, dim=1)).to(dtype)
