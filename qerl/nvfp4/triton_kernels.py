"""Triton kernels for NVFP4 (E2M1 codes, FP8 E4M3 group scales of 16, FP32 global scale) weights.

Two kernels, both reading compressed-tensors' standard layout as it sits in the checkpoint:
  * `dequantize`: packed -> BF16/FP16/FP32, bit-exact with `codec.dequantize` (memory bound: it reads
    0.5625 bytes and writes 2 bytes per weight).
  * `gemm`: y = x @ W^T for small M (decode), the weight dequantized in registers and fed to the tensor
    cores, so each packed byte is read from memory once. The tile is computed transposed (W tile is the
    MMA's M side, the few rows of x its N side), the even and odd K halves of a byte go to two dots
    against the even and odd rows of x (no interleave needed), split-K fills the machine on narrow N and
    the last CTA of each N tile reduces the partials (one launch, no memset).

The GEMM multiplies code values by the FP8 scale in BF16 (exact: a 2-bit times a 4-bit significand) and
divides by the global scale once on the FP32 accumulator: this skips one rounding of the weight to BF16
per element, so it differs from "x @ dequantize(W)" by about one BF16 ulp of W, never more.

Everything here also runs under TRITON_INTERPRET=1 on CPU tensors (the CI path): the interpreter has no
inline asm, no BF16 dot and truncates FP32->BF16, so those three steps have portable variants selected by
the INTERPRET constexpr.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# E2M1 -> BF16 for 8 codes held in one 32-bit register, times the group scale, 2 BF16 per output register.
# The two prmt lookups read the low and the high byte of each BF16 magnitude from byte tables held in
# immediates (0, .5, 1, 1.5, 2, 3, 4, 6 = 0x0000 3F00 3F80 3FC0 4000 4040 4080 40C0); the sign byte is a
# third lookup. Selectors 0x6240 / 0x7351 pick the even (low nibble) and odd (high nibble) codes. Then one
# bf16x2 FMA applies the scale (exact: 2-bit x 4-bit significands). About 3 instructions per weight,
# against ~8 for the shift/or/convert route, which matters: at the bandwidth roofline the decode kernel
# has ~4 ALU instructions per weight to spend.
_E2M1_BF16_ASM = tl.constexpr("""
{
.reg .b32 a<14>;
and.b32 a0, $4, 0x88888888;
shr.u32 a1, a0, 3;
and.b32 a2, $4, 0x77777777;
shr.u32 a3, a2, 16;
shr.u32 a4, a0, 19;
prmt.b32 a5, 0xC0800000, 0xC0804000, a2;
prmt.b32 a6, 0xC0800000, 0xC0804000, a3;
prmt.b32 a7, 0x3F3F3F00, 0x40404040, a2;
prmt.b32 a8, 0x3F3F3F00, 0x40404040, a3;
prmt.b32 a9, 0x8000, 0, a1;
prmt.b32 a10, 0x8000, 0, a4;
or.b32 a11, a7, a9;
or.b32 a12, a8, a10;
mov.b32 a13, 0x80008000;
prmt.b32 a0, a5, a11, 0x6240;
prmt.b32 a1, a6, a12, 0x6240;
prmt.b32 a2, a5, a11, 0x7351;
prmt.b32 a3, a6, a12, 0x7351;
fma.rn.bf16x2 $0, a0, $5, a13;
fma.rn.bf16x2 $1, a1, $6, a13;
fma.rn.bf16x2 $2, a2, $5, a13;
fma.rn.bf16x2 $3, a3, $6, a13;
}
""")


@triton.jit
def _e4m3_to_f32(b):
    """FP8 E4M3 bits (uint8) -> fp32, exact: the 7 magnitude bits placed as an fp16 is the value / 256."""
    bits = ((b & 0x7F).to(tl.int16) << 7) | ((b & 0x80).to(tl.int16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _e2m1_to_f32(c):
    """4-bit E2M1 code (low nibble of a uint8) -> fp32, exact: as an fp16 (subnormals too) it is value / 2^14."""
    bits = ((c & 7).to(tl.int16) << 9) | ((c & 8).to(tl.int16) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _f32_to_bf16_rne(x):
    """Round-to-nearest-even fp32 -> bf16 in integer arithmetic (the interpreter's cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _to_out(x, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    if OUT_DTYPE == tl.bfloat16:
        if INTERPRET:
            return _f32_to_bf16_rne(x)
        else:
            return x.to(tl.bfloat16)
    else:
        return x.to(OUT_DTYPE)


@triton.jit
def _dequant_kernel(
    p_ptr, s_ptr, gs_ptr, out_ptr, N, K2,
    BLOCK_N: tl.constexpr, BLOCK_K2: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One [BLOCK_N, 2*BLOCK_K2] tile of W = out_dtype(value(code) * (fp32(scale) / global_scale))."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BLOCK_G: tl.constexpr = BLOCK_K2 // 8
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = pid_k * BLOCK_K2 + tl.arange(0, BLOCK_K2)
    rg = pid_k * BLOCK_G + tl.arange(0, BLOCK_G)
    n_ok = rn < N
    rn64 = rn.to(tl.int64)  # N * K can pass 2^31 (32B gate_up: 55296 x 5120)
    p = tl.load(p_ptr + rn64[:, None] * K2 + rj[None, :], mask=n_ok[:, None] & (rj < K2)[None, :], other=0)
    sb = tl.load(s_ptr + rn64[:, None] * (K2 // 8) + rg[None, :],
                 mask=n_ok[:, None] & (rg < K2 // 8)[None, :], other=0)
    gs = tl.load(gs_ptr)
    # Division rounded as IEEE does (Triton's `/` is approximate on GPU): the codec divides in fp32.
    eff = tl.div_rn(_e4m3_to_f32(sb), gs)
    eff = tl.reshape(tl.broadcast_to(eff[:, :, None], (BLOCK_N, BLOCK_G, 8)), (BLOCK_N, BLOCK_K2))
    lo = _e2m1_to_f32(p & 0xF) * eff
    hi = _e2m1_to_f32(p >> 4) * eff
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * BLOCK_K2))  # even k from the low nibble
    rk = 2 * pid_k * BLOCK_K2 + tl.arange(0, 2 * BLOCK_K2)
    tl.store(out_ptr + rn64[:, None] * (2 * K2) + rk[None, :], _to_out(w, OUT_DTYPE, INTERPRET),
             mask=n_ok[:, None] & (rk < 2 * K2)[None, :])


@triton.jit
def _load_w_tile(p_ptr, s_ptr, rn64, n_ok, t, K2, KS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 FLAT: tl.constexpr):
    """K tile t of the packed weight ([BLOCK_N, BLOCK_K/2] if FLAT else [BLOCK_N, groups, 8]) and its scales."""
    KG: tl.constexpr = BLOCK_K // 16
    rg = t * KG + tl.arange(0, KG)
    sb = tl.load(s_ptr + rn64[:, None] * KS + rg[None, :], mask=n_ok[:, None] & (rg < KS)[None, :], other=0)
    if FLAT:
        rj = t * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        p = tl.load(p_ptr + rn64[:, None] * K2 + rj[None, :], mask=n_ok[:, None] & (rj < K2)[None, :], other=0)
    else:
        rj3 = rg[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        p = tl.load(p_ptr + rn64[:, None, None] * K2 + rj3, mask=n_ok[:, None, None] & (rj3 < K2), other=0)
    return p, sb


@triton.jit
def _decode_split(p, s, USE_ASM: tl.constexpr, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed bytes p [BLOCK_N, KG, 8] and fp32 scales s [BLOCK_N, KG] -> (even-k, odd-k) code * scale.

    The scale broadcasts along a size-8 axis of its own (free, no reshuffle). Joining the two on a new minor
    axis and merging it gives K order.
    """
    KG: tl.constexpr = BLOCK_K // 16
    if USE_ASM:
        s3 = tl.broadcast_to(s.to(tl.bfloat16)[:, :, None], (BLOCK_N, KG, 8))
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r", [p, s3],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )
    else:
        s3 = s[:, :, None]
        lo = (_e2m1_to_f32(p & 0xF) * s3).to(dtype)  # exact in bf16/fp16: no rounding here
        hi = (_e2m1_to_f32(p >> 4) * s3).to(dtype)
    return lo, hi


@triton.jit
def _gemm_kernel(
    x_ptr, p_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_xm, stride_ym, tiles_per_split,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, MODE: tl.constexpr, PREFETCH: tl.constexpr,
    USE_ASM: tl.constexpr, INTERPRET: tl.constexpr,
):
    """y[M, N] = x[M, K] @ W[N, K]^T, computed as acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T.

    MODE 0: even/odd nibbles in two dots against strided rows of x^T;
    MODE 1: nibbles interleaved in registers, one dot against a contiguous x^T tile;
    MODE 2: no tensor cores (GEMV, for 1-4 rows): fp32 FMAs into a [BLOCK_N, BLOCK_M, BLOCK_K] accumulator;
    MODE 3: no tensor cores, one row of x, everything kept as [BLOCK_N, groups, 8] (no reshape or join).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    KH: tl.constexpr = BLOCK_K // 2
    KG: tl.constexpr = BLOCK_K // 16
    K2 = K // 2
    KS = K // 16
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    rn64 = rn.to(tl.int64)
    # The interpreter needs a constexpr trip count; compiled kernels take it at run time (one binary for all
    # K). A tile past the end of K loads nothing (masks).
    t0 = pid_k * tiles_per_split
    x_dtype = x_ptr.dtype.element_ty
    if MODE == 2:
        acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    elif MODE == 3:
        acc3 = tl.zeros((BLOCK_N, KG, 8), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    r8 = tl.arange(0, 8)
    # Prefetch: the next tile's packed bytes and scales are loaded before this tile is decoded, so each CTA
    # keeps two tiles of loads in flight (Triton does not software-pipeline loads that feed inline asm).
    p_nx, sb_nx = _load_w_tile(p_ptr, s_ptr, rn64, n_ok, t0, K2, KS, BLOCK_N, BLOCK_K, MODE == 0)
    for i in range(0, TILES_PER_SPLIT if INTERPRET else tiles_per_split):
        t = t0 + i
        if PREFETCH:
            p, sb = p_nx, sb_nx
            p_nx, sb_nx = _load_w_tile(p_ptr, s_ptr, rn64, n_ok, t + 1, K2, KS, BLOCK_N, BLOCK_K, MODE == 0)
        else:
            p, sb = _load_w_tile(p_ptr, s_ptr, rn64, n_ok, t, K2, KS, BLOCK_N, BLOCK_K, MODE == 0)
        s = _e4m3_to_f32(sb)
        if MODE == 0:
            rj = t * KH + tl.arange(0, KH)
            # Even and odd rows of x^T for this K tile, matching the low and high nibbles.
            ke = 2 * rj
            x_mask = (ke < K)[:, None] & m_ok[None, :]
            xe = tl.load(x_ptr + rm[None, :] * stride_xm + ke[:, None], mask=x_mask, other=0.0)
            xo = tl.load(x_ptr + rm[None, :] * stride_xm + (ke + 1)[:, None], mask=x_mask, other=0.0)
            if USE_ASM:
                s16 = tl.reshape(tl.broadcast_to(s.to(tl.bfloat16)[:, :, None], (BLOCK_N, KG, 8)), (BLOCK_N, KH))
                lo, hi = tl.inline_asm_elementwise(
                    _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r", [p, s16],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
                )
            else:
                sx = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, KG, 8)), (BLOCK_N, KH))
                lo = (_e2m1_to_f32(p & 0xF) * sx).to(x_dtype)
                hi = (_e2m1_to_f32(p >> 4) * sx).to(x_dtype)
            if INTERPRET:  # the interpreter multiplies bf16 as raw integers
                acc = tl.dot(lo.to(tl.float32), xe.to(tl.float32), acc)
                acc = tl.dot(hi.to(tl.float32), xo.to(tl.float32), acc)
            else:
                acc = tl.dot(lo, xe, acc)
                acc = tl.dot(hi, xo, acc)
        elif MODE == 3:
            # One row of x: even/odd x as [KG, 8] tiles broadcast over the W rows; no reshape, no join.
            lo, hi = _decode_split(p, s, USE_ASM, x_dtype, BLOCK_N, BLOCK_K)
            ke3 = 2 * ((t * KG + tl.arange(0, KG))[:, None] * 8 + r8[None, :])
            xe = tl.load(x_ptr + ke3, mask=ke3 < K, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + ke3 + 1, mask=ke3 < K, other=0.0).to(tl.float32)
            acc3 += lo.to(tl.float32) * xe[None, :, :] + hi.to(tl.float32) * xo[None, :, :]
        else:
            lo, hi = _decode_split(p, s, USE_ASM, x_dtype, BLOCK_N, BLOCK_K)
            w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
            rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
            if MODE == 1:
                xt = tl.load(x_ptr + rm[None, :] * stride_xm + rk[:, None], mask=(rk < K)[:, None] & m_ok[None, :],
                             other=0.0)
                if INTERPRET:
                    acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc)
                else:
                    acc = tl.dot(w, xt, acc)
            else:
                xr = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :],
                             other=0.0)
                acc3 += w.to(tl.float32)[:, None, :] * xr.to(tl.float32)[None, :, :]
    if MODE == 3:
        acc = tl.reshape(tl.sum(tl.sum(acc3, axis=2), axis=1), (BLOCK_N, 1))
    if MODE == 2:
        acc = tl.sum(acc3, axis=2)

    y_mask = n_ok[:, None] & m_ok[None, :]
    y_off = rm[None, :] * stride_ym + rn[:, None]
    if SPLIT_K == 1:
        acc = acc / tl.load(gs_ptr)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + y_off, _to_out(acc, y_ptr.dtype.element_ty, INTERPRET), mask=y_mask)
    else:
        # Partials go to an fp32 workspace [SPLIT_K, M, N]; the CTA that arrives last for this N tile sums
        # them, writes y and re-arms the counter, so the next launch finds it at zero (graph-replay safe).
        w_off = rm[None, :] * N + rn[:, None]
        tl.store(ws_ptr + pid_k * M * N + w_off, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in range(SPLIT_K):
                total += tl.load(ws_ptr + i * M * N + w_off, mask=y_mask, other=0.0, cache_modifier=".cg")
            total = total / tl.load(gs_ptr)
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + y_off, _to_out(total, y_ptr.dtype.element_ty, INTERPRET), mask=y_mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


# --------------------------------------------------------------------------------------------- launchers

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
DEQUANT_DTYPES = tuple(_TL_DTYPE)
GEMM_DTYPES = (torch.bfloat16, torch.float16)


def dequantize(packed, scale, global_scale, dtype=torch.bfloat16, out=None, block_n=16, block_k2=256, num_warps=4):
    """W [N, K] in `dtype`, bit-exact with codec.dequantize."""
    n, k2 = packed.shape
    if out is None:
        out = torch.empty((n, 2 * k2), dtype=dtype, device=packed.device)
    if n == 0 or k2 == 0:
        return out
    block_k2 = min(block_k2, max(8, triton.next_power_of_2(k2)))
    grid = (triton.cdiv(n, block_n), triton.cdiv(k2, block_k2))
    _dequant_kernel[grid](
        packed, scale.view(torch.uint8), global_scale, out, n, k2,
        BLOCK_N=block_n, BLOCK_K2=block_k2, OUT_DTYPE=_TL_DTYPE[dtype], INTERPRET=INTERPRET,
        num_warps=num_warps,
    )
    return out


class GemmConfig(tuple):
    """(block_m, block_n, block_k, split_k, num_warps, num_stages, mode, prefetch); see _gemm_kernel."""

    def __new__(cls, block_m, block_n, block_k, split_k, num_warps=4, num_stages=4, mode=1, prefetch=1):
        return super().__new__(cls, (block_m, block_n, block_k, split_k, num_warps, num_stages, mode, prefetch))

    block_m = property(lambda s: s[0])
    block_n = property(lambda s: s[1])
    block_k = property(lambda s: s[2])
    split_k = property(lambda s: s[3])
    num_warps = property(lambda s: s[4])
    num_stages = property(lambda s: s[5])
    mode = property(lambda s: s[6])
    prefetch = property(lambda s: s[7])


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def auto_split(n: int, k: int, block_n: int, block_k: int, device: torch.device, waves: int = 2) -> int:
    """Split K until about `waves` CTAs per SM exist, keeping at least two K tiles per split."""
    k_tiles = triton.cdiv(k, block_k)
    n_tiles = triton.cdiv(n, block_n)
    target = waves * _sm_count(device)
    split = 1
    while n_tiles * split * 2 <= target and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


def default_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """Best of the H200 sweep (docs/kernel_notes.md) by row count: one row, a CUDA-core GEMV on [N, groups, 8]
    tiles; up to 16 rows, tensor cores with even/odd dots and prefetch; more, interleaved decode, one dot."""
    if m == 1:
        cfg = (1, 16, 256, 4, 4, 3, 0)
    elif m <= 16:
        cfg = (16, 64, 256, 4, 4, 0, 1)
    else:
        cfg = (max(16, triton.next_power_of_2(m)), 64, 128, 4, 4, 1, 1)
    bm, bn, bk, warps, stages, mode, prefetch = cfg
    # The one-row kernel keeps few bytes in flight per CTA, so it wants more CTAs (sweep: split 2x the rest).
    split = auto_split(n, k, bn, bk, device, waves=8 if mode == 3 else 2)
    return GemmConfig(bm, bn, bk, split, warps, stages, mode, prefetch)


class _Locks:
    """Per-device zeroed int32 counters for the split-K reduction (the kernel leaves them at zero)."""

    def __init__(self):
        self.buf: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, count: int) -> torch.Tensor:
        buf = self.buf.get(device)
        if buf is None or buf.numel() < count:
            buf = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
            self.buf[device] = buf
        return buf


_LOCKS = _Locks()


def gemm(x, packed, scale, global_scale, bias=None, out=None, config: GemmConfig | None = None, use_asm=None):
    """y = x @ W^T (+ bias) for a 2-D bf16/fp16 x with few rows."""
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"x has K={k} but the packed weight holds K={packed.shape[1] * 2}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or default_config(m, n, k, x.device)
    if use_asm is None:
        use_asm = x.dtype == torch.bfloat16 and x.is_cuda and not INTERPRET
    n_tiles = triton.cdiv(n, cfg.block_n)
    tiles = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k)
    if cfg.split_k > 1:
        ws = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        locks = _LOCKS.get(x.device, n_tiles)
    else:
        ws = locks = out  # unused
    _gemm_kernel[(n_tiles, cfg.split_k)](
        x, packed, scale.view(torch.uint8), global_scale, bias if bias is not None else out, out, ws, locks,
        m, n, k, x.stride(0), out.stride(0), tiles,
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k, TILES_PER_SPLIT=tiles if INTERPRET else 0, MODE=cfg.mode,
        PREFETCH=bool(cfg.prefetch), USE_ASM=bool(use_asm), INTERPRET=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
