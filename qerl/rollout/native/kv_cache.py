"""The native engine's KV cache: keys and values of one wave, in the model's dtype or in FP8.

    KVCache(layers, batch, capacity, kv_heads, head_dim, model_dtype, fp8, device)
        k, v [layers, B, S, Hkv, D]; with fp8, E4M3 codes and k_scale, v_scale [layers, B, S, Hkv] FP32.
    KVCache.layer(i) -> (k, v, k_scale, v_scale) of layer i (scales None without fp8), for the write and decode kernels
    KVCache.read(i, rows, length) -> K, V of rows `rows` (an index), positions [0, length), in the model's dtype
        (prefill)
    KVCache.copy_rows(sources, targets, length) -> positions [0, length) of some rows into others (a repeated prompt)
    KVCache.keep_rows(rows) -> the cache of those rows only, moved to the front of the same memory (the engine's
        live-row compaction)

The FP8 format (one scale per token and KV head, set when the token is written): scale = 2^(e - 7) for the
largest magnitude amax = m * 2^e (1 <= m < 2) of the head's D values, so every value / scale is below 256 and
within E4M3's range (448), and dividing by a power of two is exact; code = E4M3 round-to-nearest-even of
value / scale. Value = code * scale. A token's key and value thus each cost D bytes + 4 instead of 2 D bytes in
BF16. `quantize_reference` is the rule in torch: the CPU path, and what the kernels are tested against (bit for bit
under the interpreter and for values on the GPU, whose fused rotation may put a key one E4M3 step apart).
"""

from __future__ import annotations

import copy

import torch

from qerl.field_rules import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
SCALE_EXPONENT_OFFSET = 7  # value / scale < 2^8 = 256 <= E4M3's largest finite 448

try:  # Triton is Linux-only; the torch rule below keeps the CPU path working without it.
    import triton
    import triton.language as tl

    _OFFSET = tl.constexpr(SCALE_EXPONENT_OFFSET)  # what a kernel may read of a module global
except ImportError:  # pragma: no cover - depends on the platform
    triton = None


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype, taken as FP32) -> (E4M3 codes [..., D], FP32 power-of-two scales [...])."""
    x = x.float()
    amax = x.abs().amax(-1)
    exponent = (amax.view(torch.int32) >> 23) & 0xFF  # biased FP32 exponent of amax (0 for zero)
    biased = exponent.clamp(min=1 + SCALE_EXPONENT_OFFSET) - SCALE_EXPONENT_OFFSET  # a normal FP32 power of two
    scale = (biased << 23).view(torch.float32)
    inverse = ((254 - biased) << 23).view(torch.float32)  # 1 / scale, exactly
    return (x * inverse[..., None]).to(FP8), scale


_jit = triton.jit if triton is not None else (lambda fn: fn)


@_jit
def fp8_scales(amax):
    """quantize_reference's (scale, 1 / scale) for FP32 amax, in integer arithmetic (bit-exact everywhere)."""
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased = tl.maximum(exponent, 1 + _OFFSET) - _OFFSET
    return (biased << 23).to(tl.float32, bitcast=True), ((254 - biased) << 23).to(tl.float32, bitcast=True)


@_jit
def to_e4m3_bits(x, INTERPRET: tl.constexpr):
    """FP32 x (finite, |x| < 256) -> E4M3 codes as uint8, round to nearest even. The GPU converts in hardware; the
    interpreter's FP8 conversion is wrong (124 -> 64), so there the rounding is done on the FP32 bits."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        # normal codes: the FP32 bits rounded to 3 mantissa bits, exponent rebiased from 127 to 7
        normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
        # below 2^-6: multiples of 2^-9, rounded by the FP32 adder (to nearest even)
        small = ((magnitude.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        code = tl.where(magnitude >= 0x3C800000, normal, small) | ((bits >> 24) & 0x80)
        return code.to(tl.uint8)
    else:
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@_jit
def e4m3_bits_to_float(code, INTERPRET: tl.constexpr):
    """uint8 E4M3 codes -> their values, exactly: FP16 on the GPU (one conversion instruction per two codes; exact
    in BF16 too), FP32 under the interpreter (whose dot runs in FP32; the FP16 bit trick: the 7 magnitude bits
    as an FP16 are value / 256)."""
    if INTERPRET:
        bits = ((code & 0x7F).to(tl.int16) << 7) | ((code & 0x80).to(tl.int16) << 8)
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float16)


def dequantize_reference(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (codes.float() * scale[..., None]).to(dtype)


def check_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """An FP8 cache [B, S, Hkv, D] (either of K and V: they share a layout) comes with k_scale and v_scale FP32
    [B, S, Hkv] of one layout with a contiguous last dim, which is how the kernels address them."""
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.dtype != torch.float32 or t.shape != cache.shape[:3] or t.stride(2) != 1:
            raise ValueError(
                f"an FP8 cache needs {name} FP32 {tuple(cache.shape[:3])} with a contiguous last dim; "
                f"got {None if t is None else (t.dtype, tuple(t.shape))}"
            )
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale need the same strides")


def bytes_per_token(kv_heads: int, head_dim: int, model_dtype: torch.dtype, fp8: bool) -> int:
    """One layer's key + value of one token."""
    if fp8:
        return 2 * kv_heads * (head_dim + 4)
    return 2 * kv_heads * head_dim * model_dtype.itemsize


class KVCache:
    def __init__(
        self,
        layers: int,
        batch: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        model_dtype: torch.dtype,
        fp8: bool,
        device,
    ):
        self.model_dtype = model_dtype
        self.fp8 = fp8
        self.capacity = capacity
        kv = torch.empty(
            (2, layers, batch, capacity, kv_heads, head_dim), dtype=FP8 if fp8 else model_dtype, device=device
        )
        self.k, self.v = kv[0], kv[1]
        self.k_scale = self.v_scale = None
        if fp8:
            scales = torch.empty((2, layers, batch, capacity, kv_heads), dtype=torch.float32, device=device)
            self.k_scale, self.v_scale = scales[0], scales[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self._stored())

    def layer(self, i: int):
        if not self.fp8:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    def keep_rows(self, rows: torch.Tensor) -> KVCache:
        """The cache of rows `rows` (ascending, so each moves to a lower index) as rows 0..len(rows)-1 of this one's
        memory: copied there one layer at a time (extra memory: one layer's kept rows), then viewed."""
        n = len(rows)
        kept = copy.copy(self)
        for name, full in self._stored():
            for layer in _bytes(full):
                layer[:n] = layer.index_select(0, rows)
            setattr(kept, name, full[:, :n])
        return kept

    def copy_rows(self, sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        """Positions [0, length) of rows `sources` into rows `targets` (a prompt's keys and values to the rows that
        repeat it), one layer at a time (extra memory: one layer's copied rows)."""
        for _, full in self._stored():
            for layer in _bytes(full):
                layer[targets, :length] = layer[sources, :length]

    def _stored(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of what the cache holds per row: k and v, and their scales with fp8."""
        return [(name, t) for name in ("k", "v", "k_scale", "v_scale") if (t := getattr(self, name)) is not None]

    def read(self, i: int, rows: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[i][rows, :length], self.v[i][rows, :length]
        if not self.fp8:
            return k, v
        return (
            dequantize_reference(k, self.k_scale[i][rows, :length], self.model_dtype),
            dequantize_reference(v, self.v_scale[i][rows, :length], self.model_dtype),
        )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 codes as bytes, for row copies (indexing kernels need not know FP8 dtypes); other tensors as they are."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def resolve(name: str) -> bool:
    """The engine option's name -> whether the cache is FP8; a one-line error names the choices."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return name == "fp8"
