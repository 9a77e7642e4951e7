"""Triton kernels for NVFP4 (E2M1 codes, FP8 E4M3 group scales of 16, FP32 global scale) weights.

Two kernels, both reading compressed-tensors' standard layout as it sits in the checkpoint:
  * `dequantize`: packed -> BF16/FP16/FP32, bit-exact with `codec.dequantize` (memory bound: it reads
    0.5625 bytes and writes 2 bytes per weight).
  * `gemm`: y = x @ W^T for small M (decode), the weight dequantized in registers and fed to the tensor
    cores, so each packed byte is read from memory once. The tile is computed transposed (W tile is the
    MMA's M side, the few rows of x its N side); split-K fills the machine on narrow N and the last CTA of
    each N tile reduces the partials and re-arms its counter (one launch). One kernel, `_gemm_tc_kernel`, for 1-64 rows:
    the packed tiles, their scales and x stream through a TMA shared-memory ring; the weight is decoded in
    the wgmma operand layout (low and high nibbles as two dots against the even and odd K of x). Given a LoRA
    adapter (the rollout engine's projections), the same launch computes it too: programs first in the grid
    do the shrink x @ A^T, the N tiles' epilogues add the up-projection.
  Both launch with programmatic dependent launch where the GPU has it (qerl/dependent_launch.py).

The GEMM multiplies code values by the FP8 scale in BF16 (exact: a 2-bit times a 4-bit significand) and
divides by the global scale once on the FP32 accumulator: this skips one rounding of the weight to BF16
per element, so it differs from "x @ dequantize(W)" by about one BF16 ulp of W, never more.

Everything here also runs under TRITON_INTERPRET=1 on CPU tensors (the CI path): the interpreter has no
inline asm, no BF16 dot and truncates FP32->BF16, so those three steps have portable variants selected by
the INTERPRET constexpr.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qerl.dependent_launch import let_next_kernel_launch, pdl_enabled, wait_for_previous_kernel
from qerl.device_facts import INTERPRET, sm_count


@triton.jit
def _e4m3_to_f32(b):
    """FP8 E4M3 bits (uint8) -> fp32, exact: the 7 magnitude bits placed as an fp16 is value / 256."""
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
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b on the tensor cores; the interpreter multiplies bf16 as raw integers, so there in fp32."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dequant_kernel(
    p_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    N,
    K2,
    BLOCK_N: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
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
    sb = tl.load(s_ptr + rn64[:, None] * (K2 // 8) + rg[None, :], mask=n_ok[:, None] & (rg < K2 // 8)[None, :], other=0)
    gs = tl.load(gs_ptr)
    # Division rounded as IEEE does (Triton's `/` is approximate on GPU): the codec divides in fp32.
    eff = tl.div_rn(_e4m3_to_f32(sb), gs)
    eff = tl.reshape(tl.broadcast_to(eff[:, :, None], (BLOCK_N, BLOCK_G, 8)), (BLOCK_N, BLOCK_K2))
    lo = _e2m1_to_f32(p & 0xF) * eff
    hi = _e2m1_to_f32(p >> 4) * eff
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * BLOCK_K2))  # even k from the low nibble
    rk = 2 * pid_k * BLOCK_K2 + tl.arange(0, 2 * BLOCK_K2)
    tl.store(
        out_ptr + rn64[:, None] * (2 * K2) + rk[None, :],
        _to_out(w, OUT_DTYPE, INTERPRET),
        mask=n_ok[:, None] & (rk < 2 * K2)[None, :],
    )


# E2M1 -> BF16 without tables (pack=4: one 32-bit register of 4 packed bytes b0..b3; outputs $0, $1 the low
# nibbles of (b0, b1) and (b2, b3) as bf16x2, $2, $3 the high ones). The low and high nibbles are split into two
# clean registers; a byte permute places two nibbles at bits 0-3 and 16-19 of a word (zero bytes between), and
# one integer multiply by 0x1040 copies each nibble to <<12 (its sign lands on the BF16 sign bit) and to <<6 (its
# 3 magnitude bits land on the two low exponent bits and the top mantissa bit). Masked, that word is the bf16x2
# of value * 2^-126 exactly (code 1 = 0.5 becomes a BF16 subnormal); the scale operand carries 2^110, so the
# bf16x2 FMA gives code * scale * 2^-16 exactly. 20 instructions per 8 weights, 11 of them on the half-rate ALU
# pipe (the multiplies run on the FMA pipe); the shift-and-mask decode it replaces took 21, 16 on the ALU pipe.
_E2M1_BF16_ASM = tl.constexpr("""
{
.reg .b32 lo, hi, u<4>, t<4>, z;
and.b32 lo, $4, 0x0F0F0F0F;
shr.b32 hi, $4, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 u0, lo, 0, 0x4140;
prmt.b32 u1, lo, 0, 0x4342;
prmt.b32 u2, hi, 0, 0x4140;
prmt.b32 u3, hi, 0, 0x4342;
mul.lo.u32 t0, u0, 0x1040;
mul.lo.u32 t1, u1, 0x1040;
mul.lo.u32 t2, u2, 0x1040;
mul.lo.u32 t3, u3, 0x1040;
and.b32 t0, t0, 0x81C081C0;
and.b32 t1, t1, 0x81C081C0;
and.b32 t2, t2, 0x81C081C0;
and.b32 t3, t3, 0x81C081C0;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, t0, $5, z;
fma.rn.bf16x2 $1, t1, $7, z;
fma.rn.bf16x2 $2, t2, $5, z;
fma.rn.bf16x2 $3, t3, $7, z;
}
""")
# FP8 E4M3 scales -> the decode's scale operand, 4 bytes per call (pack=4): two packed conversions
# e4m3x2 -> f16x2 (exact), each f16 widened to f32, times 2^110, and rounded into both halves of a bf16x2 word
# (exact: 4-bit significand), so the decode reads one register per scale.
_E4M3_SCALE_ASM = tl.constexpr("""
{
.reg .b16 p<2>, h<4>;
.reg .b32 f<2>;
.reg .f32 g<4>;
mov.b32 {p0, p1}, $4;
cvt.rn.f16x2.e4m3x2 f0, p0;
cvt.rn.f16x2.e4m3x2 f1, p1;
mov.b32 {h0, h1}, f0;
mov.b32 {h2, h3}, f1;
cvt.f32.f16 g0, h0;
cvt.f32.f16 g1, h1;
cvt.f32.f16 g2, h2;
cvt.f32.f16 g3, h3;
mul.f32 g0, g0, 0f76800000;
mul.f32 g1, g1, 0f76800000;
mul.f32 g2, g2, 0f76800000;
mul.f32 g3, g3, 0f76800000;
cvt.rn.bf16x2.f32 $0, g0, g0;
cvt.rn.bf16x2.f32 $1, g1, g1;
cvt.rn.bf16x2.f32 $2, g2, g2;
cvt.rn.bf16x2.f32 $3, g3, g3;
}
""")
# The decode's weights are code * scale * 2^-16 (exact); the scale carries 2^110, the epilogue 2^16.
_DECODE_UNDO = tl.constexpr(2.0**16)


@triton.jit
def _perm_k(t, BLOCK_N: tl.constexpr, KH: tl.constexpr):
    """Reorder each 16-byte chunk of a [BLOCK_N, KH] tile: physical byte 4q + 2h + b goes to MMA position
    8h + 2q + b, so each thread's wgmma A fragment (K pairs 2q, 2q+1 and 2q+8, 2q+9 of every 16) is 4
    consecutive bytes in shared memory (one 32-bit load, one scale group)."""
    return tl.reshape(tl.permute(tl.reshape(t, (BLOCK_N, KH // 16, 4, 2, 2)), (0, 1, 3, 2, 4)), (BLOCK_N, KH))


# The LoRA programs: each takes 16 ranks (a q/k/v group's 48, padded to 64, at once would take the kernel from 116
# to 168 registers per thread, i.e. 3 instead of 4 programs per SM for the weight stream) over one of at most
# LORA_SPLITS K ranges, in K tiles of 64 (128: 130 registers). Short enough to finish before the N tiles reach their
# epilogues (one program per weight split walking its K range alone made the 7B step 0.6 ms slower, measured), few
# enough that each epilogue sums the partials with all loads in flight.
_LORA_RANKS = tl.constexpr(16)
_LORA_TILE_K = tl.constexpr(64)
LORA_SPLITS = 8


@triton.jit
def _lora_shrink(
    x_ptr,
    la_ptr,
    lws_ptr,
    llock_ptr,
    M,
    K,
    stride_xm,
    prog,
    lora_len,
    BLOCK_M: tl.constexpr,
    LORA_R: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_ITERS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """LoRA program `prog`: 16 ranks of the shrink over one K range, s^T = A[ranks, K range] @ x[:, K range]^T, to
    the FP32 partials [LORA_SPLITS, M, R]; then one arrival on llock[0], which the N tiles' epilogues wait for."""
    ranks = prog % (LORA_R // _LORA_RANKS)
    part = prog // (LORA_R // _LORA_RANKS)
    rr = ranks * _LORA_RANKS + tl.arange(0, _LORA_RANKS)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    acc = tl.zeros((_LORA_RANKS, BLOCK_M), dtype=tl.float32)
    for i in range(0, LORA_ITERS if INTERPRET else tl.cdiv(lora_len, _LORA_TILE_K)):
        rk = part * lora_len + i * _LORA_TILE_K + tl.arange(0, _LORA_TILE_K)
        k_ok = (rk < K) & (rk < (part + 1) * lora_len)
        a = tl.load(la_ptr + rr[:, None] * K + rk[None, :], mask=k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(a, tl.trans(x), acc, INTERPRET)
    tl.store(lws_ptr + part * M * LORA_R + rm[None, :] * LORA_R + rr[:, None], acc, mask=m_ok[None, :])
    tl.debug_barrier()  # every thread's partial is written before the release below
    tl.atomic_add(llock_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _lora_up(
    acc,
    lws_ptr,
    llock_ptr,
    lb_ptr,
    rn,
    rm,
    n_ok,
    m_ok,
    M,
    N,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LORA_R: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """acc[BLOCK_N, BLOCK_M] + (s @ B^T)^T, s = x @ A^T summed from the LoRA programs' partials (rounded to x's dtype
    once, as a separate shrink GEMM would round it) and B [N, R] the up-projection. Waits for every LoRA program;
    the last N tile to read the partials re-arms both LoRA counters for the next call."""
    programs = LORA_SPLITS * (LORA_R // _LORA_RANKS)
    # Poll with plain loads (hundreds of programs spinning on one atomic would slow the ones they wait for); the
    # LoRA programs come first in the grid, so they are running or done.
    while tl.load(llock_ptr, volatile=True) < programs:
        pass
    tl.atomic_add(llock_ptr, 0, sem="acquire", scope="gpu")  # their partials are visible from here on
    for r0 in tl.static_range(0, LORA_R, _LORA_RANKS):
        rr = r0 + tl.arange(0, _LORA_RANKS)
        s = tl.zeros((_LORA_RANKS, BLOCK_M), dtype=tl.float32)
        for part in tl.static_range(LORA_SPLITS):  # unrolled: all loads in flight at once
            s += tl.load(
                lws_ptr + part * M * LORA_R + rm[None, :] * LORA_R + rr[:, None],
                mask=m_ok[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
        lb = tl.load(lb_ptr + rn.to(tl.int64)[:, None] * LORA_R + rr[None, :], mask=n_ok[:, None], other=0.0)
        acc = _dot(lb, _to_out(s, lb.dtype, INTERPRET), acc, INTERPRET)
    done = tl.atomic_add(llock_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.cdiv(N, BLOCK_N) - 1:  # every N tile has read the partials
        tl.store(llock_ptr, 0)
        tl.store(llock_ptr + 1, 0)
    return acc


@triton.jit
def _split_epilogue(
    acc,
    scale,
    gs_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    lock_ptr,
    lws_ptr,
    llock_ptr,
    lb_ptr,
    rn,
    rm,
    M,
    N,
    stride_ym,
    pid_n,
    pid_k,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    LORA_R: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """y = acc * scale / global_scale (+ bias) (+ LoRA's s @ B^T); with split-K the last CTA of the N tile sums the
    partials."""
    n_ok = rn < N
    m_ok = rm < M
    y_mask = n_ok[:, None] & m_ok[None, :]
    y_off = rm[None, :] * stride_ym + rn[:, None]
    if SPLIT_K == 1:
        acc = acc * scale / tl.load(gs_ptr)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if LORA_R > 0:
            acc = _lora_up(
                acc,
                lws_ptr,
                llock_ptr,
                lb_ptr,
                rn,
                rm,
                n_ok,
                m_ok,
                M,
                N,
                BLOCK_N,
                BLOCK_M,
                LORA_R,
                LORA_SPLITS,
                INTERPRET,
            )
        tl.store(y_ptr + y_off, _to_out(acc, y_ptr.dtype.element_ty, INTERPRET), mask=y_mask)
    else:
        w_off = rm[None, :] * N + rn[:, None]
        tl.store(ws_ptr + pid_k * M * N + w_off, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for i in range(SPLIT_K):
                total += tl.load(ws_ptr + i * M * N + w_off, mask=y_mask, other=0.0, cache_modifier=".cg")
            total = total * scale / tl.load(gs_ptr)
            if HAS_BIAS:
                total += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            if LORA_R > 0:
                total = _lora_up(
                    total,
                    lws_ptr,
                    llock_ptr,
                    lb_ptr,
                    rn,
                    rm,
                    n_ok,
                    m_ok,
                    M,
                    N,
                    BLOCK_N,
                    BLOCK_M,
                    LORA_R,
                    LORA_SPLITS,
                    INTERPRET,
                )
            tl.store(y_ptr + y_off, _to_out(total, y_ptr.dtype.element_ty, INTERPRET), mask=y_mask)
            tl.store(lock_ptr + pid_n, 0)  # re-armed for the next call: every other CTA of this tile has arrived


@triton.jit
def _gemm_tc_kernel(
    x_ptr,
    p_ptr,
    s_ptr,
    x_desc,
    p_desc,
    s_desc,
    gs_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    lock_ptr,
    la_ptr,
    lb_ptr,
    lws_ptr,
    llock_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    tiles_per_split,
    lora_len,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr,
    STAGES: tl.constexpr,
    TMA_P: tl.constexpr,
    TMA_S: tl.constexpr,
    USE_ASM: tl.constexpr,
    LORA_R: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_ITERS: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """y[M, N] = x @ W^T as acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile^T on the tensor cores, the weight streamed.

    The packed bytes, the scales and x arrive by TMA into a STAGES-deep shared-memory ring (Triton's pipeliner
    turns the descriptor loads inside tl.range into async copies + mbarriers), so the bytes in flight do not
    depend on registers. The low and high nibbles of a byte are two dots against the even and odd K of x.
    K order inside each tile is permuted (_perm_k) so that the packed tile is read from shared memory straight
    into the wgmma A-operand layout, 4 bytes per load; x is read as 32-bit (even, odd) pairs in natural order,
    split and permuted the same way on its way into the B-operand buffer (no gathers).
    USE_ASM: scales converted 4 per call, then the E2M1 decode (byte permute + multiply), in inline PTX (else
    the portable shift/convert decode, fp32 dot). Without TMA (K % 256 != 0, the interpreter) the same tiles take
    plain loads.
    LORA_R > 0: a LoRA adapter (A [R, K], B [N, R]) rides along in the same launch. The grid's first programs
    compute the shrink s = x @ A^T (16 ranks over one of LORA_SPLITS K ranges each) and the N tiles add s @ B^T in
    their epilogue (the rollout engine's projections: no separate shrink GEMM, no extra launch).
    One-dimensional grid: [LoRA programs,] then (N tile, K split) with the N tile fastest.
    """
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    if LORA_R > 0:
        lora_programs = LORA_SPLITS * (LORA_R // _LORA_RANKS)
        if pid < lora_programs:
            _lora_shrink(
                x_ptr,
                la_ptr,
                lws_ptr,
                llock_ptr,
                M,
                K,
                stride_xm,
                pid,
                lora_len,
                BLOCK_M,
                LORA_R,
                LORA_SPLITS,
                LORA_ITERS,
                INTERPRET,
            )
            return
        pid -= lora_programs
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_n = pid % n_tiles
    pid_k = pid // n_tiles
    KH: tl.constexpr = BLOCK_K // 2
    KG: tl.constexpr = BLOCK_K // 16
    K2 = K // 2
    KS = K // 16
    n0 = pid_n * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok = rn < N
    m_ok = rm < M
    rn64 = rn.to(tl.int64)
    x_dtype = x_ptr.dtype.element_ty
    x32_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    stride_x32 = stride_xm // 2
    t0 = pid_k * tiles_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in tl.range(0, TILES_PER_SPLIT if INTERPRET else tiles_per_split, num_stages=STAGES):
        t = t0 + i
        if TMA_P:
            p = p_desc.load([n0, t * KH])
        else:
            rj = t * KH + tl.arange(0, KH)
            p = tl.load(p_ptr + rn64[:, None] * K2 + rj[None, :], mask=n_ok[:, None] & (rj < K2)[None, :], other=0)
        if TMA_S:
            sb = s_desc.load([n0, t * KG])
        else:
            rg = t * KG + tl.arange(0, KG)
            sb = tl.load(s_ptr + rn64[:, None] * KS + rg[None, :], mask=n_ok[:, None] & (rg < KS)[None, :], other=0)
        p = _perm_k(p, BLOCK_N, KH)
        if not USE_ASM:
            s = _e4m3_to_f32(sb)
            s16 = _perm_k(tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, KG, 8)), (BLOCK_N, KH)), BLOCK_N, KH)
            lo = (_e2m1_to_f32(p & 0xF) * s16).to(x_dtype)  # exact: no rounding
            hi = (_e2m1_to_f32(p >> 4) * s16).to(x_dtype)
        else:
            s = tl.inline_asm_elementwise(_E4M3_SCALE_ASM, "=r,=r,=r,=r,r", [sb], dtype=tl.int32, is_pure=True, pack=4)
            s16 = _perm_k(tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, KG, 8)), (BLOCK_N, KH)), BLOCK_N, KH)
            lo, hi = tl.inline_asm_elementwise(
                _E2M1_BF16_ASM,
                "=r,=r,=r,=r,r,r,r,r,r",
                [p, s16],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=4,
            )
        # x as 32-bit (even, odd) pairs in natural K order (contiguous, vector loads), split, then K-permuted
        # like the packed tile (the permutation lands in the shared-memory store of the dot operand).
        if TMA_P:
            xp = x_desc.load([0, t * KH])
        else:
            rj = t * KH + tl.arange(0, KH)
            xp = tl.load(
                x32_ptr + rm[:, None] * stride_x32 + rj[None, :], mask=m_ok[:, None] & (rj < K2)[None, :], other=0
            )
        xp = xp.to(tl.uint32, bitcast=True)
        xe = tl.trans(_perm_k((xp & 0xFFFF).to(tl.uint16).to(x_dtype, bitcast=True), BLOCK_M, KH))
        xo = tl.trans(_perm_k((xp >> 16).to(tl.uint16).to(x_dtype, bitcast=True), BLOCK_M, KH))
        acc = _dot(lo, xe, acc, INTERPRET)
        acc = _dot(hi, xo, acc, INTERPRET)
    let_next_kernel_launch(PDL)  # the weight stream is done; only the epilogue is left
    _split_epilogue(
        acc,
        _DECODE_UNDO if USE_ASM else 1.0,
        gs_ptr,
        b_ptr,
        y_ptr,
        ws_ptr,
        lock_ptr,
        lws_ptr,
        llock_ptr,
        lb_ptr,
        rn,
        rm,
        M,
        N,
        stride_ym,
        pid_n,
        pid_k,
        HAS_BIAS,
        BLOCK_N,
        BLOCK_M,
        SPLIT_K,
        LORA_R,
        LORA_SPLITS,
        INTERPRET,
    )


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
        packed,
        scale.view(torch.uint8),
        global_scale,
        out,
        n,
        k2,
        BLOCK_N=block_n,
        BLOCK_K2=block_k2,
        OUT_DTYPE=_TL_DTYPE[dtype],
        INTERPRET=INTERPRET,
        num_warps=num_warps,
    )
    return out


class GemmConfig(tuple):
    """(block_m, block_n, block_k, split_k, num_warps, num_stages) of _gemm_tc_kernel (num_stages: TMA ring depth)."""

    def __new__(cls, block_m, block_n, block_k, split_k, num_warps=4, num_stages=3):
        return super().__new__(cls, (block_m, block_n, block_k, split_k, num_warps, num_stages))

    block_m = property(lambda s: s[0])
    block_n = property(lambda s: s[1])
    block_k = property(lambda s: s[2])
    split_k = property(lambda s: s[3])
    num_warps = property(lambda s: s[4])
    num_stages = property(lambda s: s[5])


def auto_split(n: int, k: int, block_n: int, block_k: int, device: torch.device, waves: int = 2) -> int:
    """Split K (powers of two) until at least `waves` CTAs per SM exist, keeping at least two K tiles per split."""
    k_tiles = triton.cdiv(k, block_k)
    n_tiles = triton.cdiv(n, block_n)
    target = waves * sm_count(device)
    split = 1
    while n_tiles * split < target and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


def decode_split(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Split-K for up to 16 rows, fitted to the H200 sweep (docs/kernel_notes.md; 4 CTAs fit per SM): double the
    split until there are 3.3 CTAs per SM (down to one K tile per split: the narrow 7B qkv/o want 4.4 CTAs per SM
    at 1.75 tiles), then keep doubling while that stays within 8 CTAs per SM and leaves 4 K tiles per split (the
    long-K 7B down: split 16). `gemm` then drops splits left without K tiles (7B qkv: 14 tiles, 8 -> 7 splits)."""
    k_tiles = triton.cdiv(k, block_k)
    n_tiles = triton.cdiv(n, block_n)
    sms = sm_count(device)
    split = 1
    while k_tiles // (split * 2) >= 1 and (
        n_tiles * split < 3.3 * sms or (n_tiles * split * 2 <= 8 * sms and k_tiles // (split * 2) >= 4)
    ):
        split *= 2
    return split


@functools.lru_cache(maxsize=4096)  # called on every launch: eager decode is bound by host time
def default_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """From the H200 runs (docs/kernel_notes.md): 64-row weight tiles, 4 warps. Up to 16 rows 256-wide K tiles in a
    3-deep ring, split by decode_split; 17-32 rows the same tiles, split until 2 CTAs per SM; 33-64 rows 128-wide
    K tiles (the x tile grows with BLOCK_M), split until 1 CTA per SM: 128-row tiles on 8 warps (two warpgroups
    share each x tile) for weights of 2^25 elements and more, 64-row tiles in a 4-deep ring below that."""
    if m <= 16:
        return GemmConfig(16, 64, 256, decode_split(n, k, 64, 256, device), 4, 3)
    if m <= 32:
        return GemmConfig(32, 64, 256, auto_split(n, k, 64, 256, device, waves=2), 4, 3)
    if n * k >= 2**25:
        return GemmConfig(64, 128, 128, auto_split(n, k, 128, 128, device, waves=1), 8, 3)
    return GemmConfig(64, 64, 128, auto_split(n, k, 64, 128, device, waves=1), 4, 4)


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base and 16-byte aligned row strides (K % 32 for the packed bytes, K % 256 for
    the scales); anything else takes the kernel's plain-load path."""
    return t.is_cuda and not INTERPRET and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[1] % 16 == 0


def gemm(
    x,
    packed,
    scale,
    global_scale,
    bias=None,
    out=None,
    config: GemmConfig | None = None,
    use_asm=None,
    counters: torch.Tensor | None = None,
    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """y = x @ W^T (+ bias) (+ (x @ A^T) @ B^T) for a 2-D bf16/fp16 x with few rows.

    `counters` (int32, kept with the weight: kernels.splitk_counters): two for the LoRA programs, then the split-K
    arrival counters, one per N tile, all zero (what follows is the CUDA kernel's). The kernel leaves them zeroed, so
    they are allocated once, before any CUDA-graph capture; without them each call that needs them allocates and
    zeroes its own (one memset launch more). Two calls sharing counters must not run concurrently.
    `lora` = (A [R, K], B [N, R]), contiguous, x's dtype, R a power of two >= 16: a LoRA adapter computed in the
    same launch (saves the rollout engine the shrink GEMM's launch and the separate pass over y).
    """
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"x has K={k} but the packed weight holds K={packed.shape[1] * 2}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # x is read as 32-bit (even, odd) pairs, by TMA if it can
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    lora_r = 0
    if lora is not None:
        lora_a, lora_b = lora
        lora_r = lora_a.shape[0]
        if lora_r < 16 or lora_r & (lora_r - 1) or lora_a.shape != (lora_r, k) or lora_b.shape != (n, lora_r):
            raise ValueError(
                f"lora: A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit x {m}x{k}, W "
                f"{n}x{k} with a rank that is a power of two >= 16"
            )
        if not (lora_a.is_contiguous() and lora_b.is_contiguous()) or {lora_a.dtype, lora_b.dtype} != {x.dtype}:
            raise ValueError(f"lora: A and B must be contiguous and in x's dtype {x.dtype}")
    cfg = config or default_config(m, n, k, x.device)
    if use_asm is None:
        use_asm = x.dtype == torch.bfloat16 and x.is_cuda and not INTERPRET
    n_tiles = triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, cfg.block_k)
    tiles = triton.cdiv(k_tiles, cfg.split_k)
    split = triton.cdiv(k_tiles, tiles)  # no split without K tiles: 14 tiles in 8 splits run as 7 splits of 2
    ws = locks = lora_locks = out  # unused unless split-K or LoRA need them
    tile_k = _LORA_TILE_K.value
    lora_splits = lora_len = 0
    if lora_r:
        lora_splits = min(LORA_SPLITS, triton.cdiv(k, 256))
        lora_len = triton.cdiv(triton.cdiv(k, lora_splits), tile_k) * tile_k  # each LoRA program's K range
    if split > 1 or lora_r:
        # fp32 partials: [split, M, N] of y for split-K, then [LoRA splits, M, R] of the LoRA shrink
        ws = torch.empty(split * m * n + lora_splits * m * lora_r, dtype=torch.float32, device=x.device)
        if counters is None or counters.numel() < 2 + n_tiles or counters.device != x.device:
            counters = torch.zeros(2 + n_tiles, dtype=torch.int32, device=x.device)
        lora_locks, locks = counters[:2], counters[2:]
    lora_ws = ws[split * m * n :] if lora_r else ws
    scale_u8 = scale.view(torch.uint8)
    pdl = pdl_enabled(x.device)
    common = dict(
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=split,
        TILES_PER_SPLIT=tiles if INTERPRET else 0,
        USE_ASM=bool(use_asm),
        LORA_R=lora_r,
        LORA_SPLITS=lora_splits,
        LORA_ITERS=lora_len // tile_k if INTERPRET else 0,
        PDL=pdl,
        INTERPRET=INTERPRET,
        num_warps=cfg.num_warps,
        launch_pdl=pdl,
    )
    la, lb = lora if lora is not None else (out, out)  # unused without LoRA
    args = (
        global_scale,
        bias if bias is not None else out,
        out,
        ws,
        locks,
        la,
        lb,
        lora_ws,
        lora_locks,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        tiles,
        lora_len,
    )
    # Host-side TMA descriptors (passed by value, so CUDA graphs capture them); the scale tile's rows are
    # BLOCK_K/16 bytes, which TMA takes from 16 up; x is read as int32 (even, odd) pairs.
    tma_p = _tma_ok(packed)
    tma_s = tma_p and cfg.block_k >= 256 and _tma_ok(scale_u8)
    p_desc = TensorDescriptor.from_tensor(packed, [cfg.block_n, cfg.block_k // 2]) if tma_p else packed
    s_desc = TensorDescriptor.from_tensor(scale_u8, [cfg.block_n, cfg.block_k // 16]) if tma_s else scale_u8
    x_desc = TensorDescriptor.from_tensor(x.view(torch.int32), [cfg.block_m, cfg.block_k // 2]) if tma_p else x
    grid = (lora_splits * lora_r // _LORA_RANKS.value + n_tiles * split,)
    _gemm_tc_kernel[grid](
        x, packed, scale_u8, x_desc, p_desc, s_desc, *args, STAGES=cfg.num_stages, TMA_P=tma_p, TMA_S=tma_s, **common
    )
    return out
