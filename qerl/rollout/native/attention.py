"""Decode attention over a per-sequence KV cache: one new query token per sequence, cost following real lengths.

    decode_attention(q, k_cache, v_cache, seq_lens, scale, out=None, num_splits=None, workspace=None,
                     k_scale=None, v_scale=None, window=None) -> out
        q [B, Hq, D], k_cache/v_cache [B, S_max, Hkv, D] (q's dtype, or FP8 E4M3 codes with FP32 scales
        k_scale/v_scale [B, S_max, Hkv]: kv_cache.py's format), seq_lens int32 [B] on the device;
        sequence b attends to its keys 0 .. seq_lens[b]-1 and never reads the positions after them; with a
        sliding window, only to its last `window` keys (transformers' rule: key position > query position - window).
    decode_attention_reference(q, k_cache, v_cache, seq_lens, scale, k_scale=None, v_scale=None, window=None) ->
        the same in plain torch (float32 math or wider), masking by seq_lens (and the window): the tests' reference
        and the path on devices without Triton.

Flash-decoding: kernel 1 (grid B x Hkv x num_splits) gives each program one KV head of one sequence and one
range of keys, its GQA group's query heads as one padded tile so the tensor cores do QK^T and PV, with an
online softmax in fp32; it writes the split's normalized output and log-sum-exp. Kernel 2 merges the splits
of each (sequence, query head). The grid depends only on shapes and splits past seq_lens[b] (or wholly before a
sliding window) return at once, so a CUDA graph captures one launch pair for any lengths (no host sync, no
data-dependent allocation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl.dependent_launch import pdl_enabled
from qerl.device_facts import INTERPRET, sm_count, triton_runs_on
from qerl.rollout.native import kv_cache

try:  # Triton is Linux-only; the torch reference keeps everything working without it.
    import triton
    import triton.language as tl

    from qerl.dependent_launch import let_next_kernel_launch, wait_for_previous_kernel
except ImportError:  # pragma: no cover - depends on the platform
    triton = None

KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the split kernel (benchmarks/probes/decode_attention.py times the alternatives;
    docs/benchmarks.md has the H100 figures: 8 warps at 8 programs per SM is faster at 7B batch 8, 12.7 vs 14.9 us, and
    no faster in the decode step's graph; at batch 64 the runs so far do not rank the shapes).

    block_s: keys per tile (one [block_s, D] K and V tile per step). num_splits rule (see _splits): enough
    programs for programs_per_sm per SM when every sequence is S_max long (shorter ones leave their tail splits
    empty, so aim above one wave), but no split shorter than MIN_TILES_PER_SPLIT tiles (each split reloads q and
    writes a partial) and at most MAX_SPLITS (the merge kernel holds all of one head's splits in registers)."""

    block_s: int = 64
    num_stages: int = 2
    num_warps: int = 4
    programs_per_sm: int = 4


DEFAULT_CONFIG = DecodeConfig()
# FP8 caches hold half the bytes per tile. Where batch x KV heads fills the GPU (>= 256 programs before splitting),
# 128-key tiles in a 3-deep pipeline read faster; below, they lose. H100, context 1280
# (benchmarks.probes.decode_attention --kv-dtype fp8): 7B batch 64 48.2 vs 54.3 us, 32B batch 64 80.7 vs 102.2; 32B
# batch 8 19.8 vs 16.6.
FP8_WIDE_CONFIG = DecodeConfig(block_s=128, num_stages=3)
FP8_WIDE_MIN_PROGRAMS = 256
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634  # the kernels take exp2: scores are scaled by scale * log2(e)


def _jit(**options):
    return triton.jit(**options) if triton is not None else (lambda fn: fn)


# Runtime integers whose value follows the round's KV capacity (a split count, a window clamped to the capacity, the
# FP8 scales' batch stride): Triton would specialize them (== 1, divisible by 16) and compile again when a round's
# capacity crosses a boundary, inside a timed call or a training step. No compile-time constant of these kernels may
# depend on the capacity (tests/qerl/rollout/native/test_attention.py holds it).
_CAPACITY_ARGS = ["splits", "window", "stride_sb"]  # the merge kernel has the first two


@_jit()
def _dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b on the tensor cores (16-bit operands, fp32 accumulator); the interpreter multiplies 16-bit
    floats as raw integers, so there it takes fp32 operands."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a.to(b.dtype), b, acc)


@_jit()
def _tile(
    q,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    kv_off,
    scale_off,
    stride_ks,
    stride_ss,
    s0,
    end,
    qk_scale,
    m,
    denom,
    acc,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One step of _split_kernel's online softmax: keys [s0, min(s0 + BLOCK_S, end)) -> the new (m, denom, acc)."""
    rs = s0 + tl.arange(0, BLOCK_S)
    s_ok = rs < end
    # Masked loads: positions past seq_len are never read (they may hold anything, NaN included).
    k = tl.load(k_ptr + kv_off + rs[:, None] * stride_ks, mask=s_ok[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off + rs[:, None] * stride_ks, mask=s_ok[:, None], other=0.0)
    if FP8:
        k = kv_cache.e4m3_bits_to_float(k, INTERPRET).to(q.dtype)  # exact: E4M3 values are FP16 and BF16 values
        v = kv_cache.e4m3_bits_to_float(v, INTERPRET).to(q.dtype)
        k_scale = tl.load(ks_ptr + scale_off + rs * stride_ss, mask=s_ok, other=0.0) * qk_scale
        v_scale = tl.load(vs_ptr + scale_off + rs * stride_ss, mask=s_ok, other=0.0)
        qk = _dot(q, tl.trans(k), tl.zeros((BLOCK_H, BLOCK_S), tl.float32), INTERPRET) * k_scale[None, :]
    else:
        qk = _dot(q, tl.trans(k), tl.zeros((BLOCK_H, BLOCK_S), tl.float32), INTERPRET) * qk_scale
    qk = tl.where(s_ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))  # finite: every tile holds at least one valid key
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    if FP8:
        acc = _dot(p * v_scale[None, :], v, acc * alpha[:, None], INTERPRET)
    else:
        acc = _dot(p, v, acc * alpha[:, None], INTERPRET)
    return m_new, denom, acc


@_jit(do_not_specialize=_CAPACITY_ARGS)
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_sb,
    stride_ss,
    stride_ob,
    stride_oh,
    split_len,
    splits,
    window,
    qk_scale,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Keys [max(split * split_len, seq_len - window), min((split + 1) * split_len, seq_len)) of one sequence and
    KV head, for the GROUP query heads sharing it: the output itself when DIRECT (one split whatever the capacity),
    else the split's normalized output and
    log2-sum-exp (scores in log2 units: qk_scale = scale * log2(e), so exp2 replaces exp). FP8 caches hold E4M3
    codes with one scale per key (ks_ptr) and value (vs_ptr): the codes go to the tensor cores as they are, the
    key scales multiply the scores' columns and the value scales the probabilities' columns."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)  # before the wait: see decode_attention
    wait_for_previous_kernel(PDL)
    end = tl.minimum((split + 1) * split_len, seq_len)
    start = tl.maximum(split * split_len, seq_len - window)
    if start >= end:  # past this sequence's keys or before its window: nothing to read, and the merge skips it
        return

    rh = tl.arange(0, BLOCK_H)
    rd = tl.arange(0, D)
    heads = kv_head * GROUP + rh
    h_ok = rh < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + rd[None, :], mask=h_ok[:, None], other=0.0)
    kv_off = b * stride_kb + kv_head * stride_kh + rd[None, :]
    scale_off = b * stride_sb + kv_head

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    if INTERPRET:  # Triton 3.6's interpreter turns range bounds into ints by int(1-element array), which NumPy
        s0 = start  # >= 2.4 refuses ("only 0-dimensional arrays ..."); a while loop only takes their truth value
        while s0 < end:
            m, denom, acc = _tile(
                q,
                k_ptr,
                v_ptr,
                ks_ptr,
                vs_ptr,
                kv_off,
                scale_off,
                stride_ks,
                stride_ss,
                s0,
                end,
                qk_scale,
                m,
                denom,
                acc,
                BLOCK_H,
                BLOCK_S,
                FP8,
                INTERPRET,
            )
            s0 += BLOCK_S
    else:  # the same tiles, software-pipelined
        for s0 in tl.range(start, end, BLOCK_S, num_stages=NUM_STAGES):
            m, denom, acc = _tile(
                q,
                k_ptr,
                v_ptr,
                ks_ptr,
                vs_ptr,
                kv_off,
                scale_off,
                stride_ks,
                stride_ss,
                s0,
                end,
                qk_scale,
                m,
                denom,
                acc,
                BLOCK_H,
                BLOCK_S,
                FP8,
                INTERPRET,
            )

    let_next_kernel_launch(PDL)
    o = acc / denom[:, None]
    if DIRECT:
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + rd[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        row = (b * HQ + heads) * splits + split  # partials are [B, Hq, splits, D] and [B, Hq, splits]
        tl.store(part_ptr + row[:, None] * D + rd[None, :], o, mask=h_ok[:, None])
        tl.store(lse_ptr + row, m + tl.log2(denom), mask=h_ok)


@_jit(do_not_specialize=_CAPACITY_ARGS[:2])
def _merge_kernel(
    lens_ptr,
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    split_len,
    splits,
    window,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[b, head] = the splits' outputs weighted by exp2(lse), over the splits that hold keys of sequence b."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)  # before the wait (the split kernel does not write it)
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)  # one wave of programs
    rs = tl.arange(0, BLOCK_SPLITS)
    rd = tl.arange(0, D)
    s_ok = (rs < tl.cdiv(seq_len, split_len)) & (rs >= tl.maximum(seq_len - window, 0) // split_len)
    row = (b * HQ + head) * splits + rs
    lse = tl.load(lse_ptr + row, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_ptr + row[:, None] * D + rd[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + rd, o.to(out_ptr.dtype.element_ty))


# --------------------------------------------------------------------------------------------- host side


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _splits(
    batch: int,
    kv_heads: int,
    max_len: int,
    device: torch.device,
    num_splits: int | None,
    config: DecodeConfig = DEFAULT_CONFIG,
) -> tuple[int, int]:
    """(splits, keys per split) from static shapes only, so one CUDA graph serves every set of lengths.
    Default: DecodeConfig's rule. Either way each split covers whole tiles and none is empty at S_max."""
    tiles = _cdiv(max_len, config.block_s)
    if num_splits is None:
        want = _cdiv(config.programs_per_sm * sm_count(device), batch * kv_heads)
        num_splits = min(want, _cdiv(tiles, MIN_TILES_PER_SPLIT))
    tiles_per_split = _cdiv(tiles, max(1, min(num_splits, tiles, MAX_SPLITS)))
    return _cdiv(tiles, tiles_per_split), tiles_per_split * config.block_s


def _most_splits(
    batch: int, kv_heads: int, device: torch.device, num_splits: int | None, config: DecodeConfig = DEFAULT_CONFIG
) -> int:
    """The most splits _splits gives these shapes at any capacity: what the kernels' compile-time constants are
    sized by (the merge's register block, whether the split kernel writes the output itself), so that a round of
    another capacity runs the same compiled kernels."""
    if num_splits is None:
        num_splits = _cdiv(config.programs_per_sm * sm_count(device), batch * kv_heads)
    return max(1, min(num_splits, MAX_SPLITS))


def default_config(q: torch.Tensor, k_cache: torch.Tensor) -> DecodeConfig:
    """The launch shape decode_attention takes when given none."""
    if k_cache.dtype == kv_cache.FP8 and q.shape[0] * k_cache.shape[2] >= FP8_WIDE_MIN_PROGRAMS:
        return FP8_WIDE_CONFIG
    return DEFAULT_CONFIG


def decode_workspace(
    q: torch.Tensor, k_cache: torch.Tensor, num_splits: int | None = None, config: DecodeConfig | None = None
) -> torch.Tensor:
    """fp32 scratch for decode_attention's split partials at these shapes (pass the same num_splits and config):
    allocate it once, before capturing a CUDA graph, and hand it in as `workspace`."""
    config = config or default_config(q, k_cache)
    b, hq, d = q.shape
    splits, _ = _splits(b, k_cache.shape[2], k_cache.shape[1], q.device, num_splits, config)
    return torch.empty(b * hq * splits * (d + 1), dtype=torch.float32, device=q.device)


def _check(q, k_cache, v_cache, seq_lens, k_scale=None, v_scale=None):
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"q must be [B, Hq, D] and k_cache [B, S_max, Hkv, D]; got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    b, hq, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} disagree on B or D"
        )
    if hq % k_cache.shape[2]:
        raise ValueError(f"q's {hq} heads are not a multiple of k_cache's {k_cache.shape[2]} KV heads")
    if d < 16 or d & (d - 1):
        raise ValueError(f"q and k_cache: head dim D={d} must be a power of two >= 16")
    if seq_lens.shape != (b,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{b}]; got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if k_cache.dtype == kv_cache.FP8:
        kv_cache.check_scales(k_cache, k_scale, v_scale)


def decode_attention(
    q,
    k_cache,
    v_cache,
    seq_lens,
    scale,
    out=None,
    num_splits=None,
    workspace=None,
    config: DecodeConfig | None = None,
    k_scale=None,
    v_scale=None,
    window: int | None = None,
):
    """softmax(q . K^T * scale) V per sequence over its first seq_lens[b] cached keys -> out [B, Hq, D] in q's dtype.

    The Triton kernels on CUDA (and on CPU under TRITON_INTERPRET=1) for bf16/fp16; the torch reference otherwise.
    num_splits: key ranges per sequence (default: _splits' rule from B, Hkv, S_max and the SM count).
    workspace: from decode_workspace (else allocated per call, which a CUDA graph's private pool also serves).
    config: the split kernel's launch shape (default: default_config(q, k_cache)).
    k_scale, v_scale: FP32 [B, S_max, Hkv], the scales of FP8 (E4M3) caches (kv_cache's format); None otherwise.
    window: a sliding window (keys past seq_lens[b] - window are skipped, tiles wholly before it never read).
    With PDL the kernels read seq_lens before they wait for the previous kernel, which must not write it.
    """
    _check(q, k_cache, v_cache, seq_lens, k_scale, v_scale)
    fp8 = k_cache.dtype == kv_cache.FP8
    config = config or default_config(q, k_cache)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)}; got {out.dtype} {tuple(out.shape)}")
    kernel_dtypes = q.dtype in KERNEL_DTYPES and v_cache.dtype == k_cache.dtype in (q.dtype, kv_cache.FP8)
    if not (triton_runs_on(q) and kernel_dtypes):
        return out.copy_(decode_attention_reference(q, k_cache, v_cache, seq_lens, scale, k_scale, v_scale, window))
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or out.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q, k_cache, v_cache and out need a contiguous last dim, and the caches the same strides")

    b, hq, d = q.shape
    max_len, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    window = max_len if window is None else min(window, max_len)
    splits, split_len = _splits(b, hkv, max_len, q.device, num_splits, config)
    most_splits = _most_splits(b, hkv, q.device, num_splits, config)
    direct = most_splits == 1  # else partials and a merge, even at a capacity that needs one split
    pdl = pdl_enabled(q.device)
    if not direct:
        size = b * hq * splits * d
        if workspace is None:
            workspace = torch.empty(size + b * hq * splits, dtype=torch.float32, device=q.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < size + b * hq * splits:
            raise ValueError("workspace too small or not fp32: build it with decode_workspace(q, k_cache, num_splits)")
        part, lse = workspace[:size], workspace[size:]
    else:
        part = lse = out  # unused: the split kernel writes out directly
    if fp8:  # the kernel reads the codes as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = seq_lens  # not read
    _split_kernel[(b, hkv, splits)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        seq_lens,
        out,
        part,
        lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale.stride(0) if fp8 else 0,
        k_scale.stride(1) if fp8 else 0,
        out.stride(0),
        out.stride(1),
        split_len,
        splits,
        window,
        scale * _LOG2E,
        HQ=hq,
        GROUP=group,
        D=d,
        DIRECT=direct,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_S=config.block_s,
        NUM_STAGES=config.num_stages,
        FP8=fp8,
        PDL=pdl,
        INTERPRET=INTERPRET,
        num_warps=config.num_warps,
        launch_pdl=pdl,
    )
    if not direct:
        _merge_kernel[(b, hq)](
            seq_lens,
            part,
            lse,
            out,
            out.stride(0),
            out.stride(1),
            split_len,
            splits,
            window,
            HQ=hq,
            D=d,
            BLOCK_SPLITS=triton.next_power_of_2(most_splits),
            PDL=pdl,
            num_warps=4,
            launch_pdl=pdl,
        )
    return out


def decode_attention_reference(q, k_cache, v_cache, seq_lens, scale, k_scale=None, v_scale=None, window=None):
    """decode_attention in plain torch, in float32 (or q's dtype if wider), masking the keys past seq_lens and
    before the window (their values are zeroed too, so garbage there, NaN included, cannot leak in). FP8 caches are
    dequantized first."""
    _check(q, k_cache, v_cache, seq_lens, k_scale, v_scale)
    dtype = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k_cache.shape[2]
    keys = torch.arange(k_cache.shape[1], device=q.device)
    valid = keys < seq_lens[:, None]  # [B, S_max]
    if window is not None:
        valid &= keys >= seq_lens[:, None] - window
    if k_cache.dtype == kv_cache.FP8:  # garbage past seq_lens dequantizes to garbage, masked below
        k_cache = kv_cache.dequantize_reference(k_cache, k_scale, dtype)
        v_cache = kv_cache.dequantize_reference(v_cache, v_scale, dtype)
    k = k_cache.to(dtype).repeat_interleave(group, dim=2)  # [B, S_max, Hq, D]
    v = torch.where(valid[:, :, None, None], v_cache.to(dtype), 0).repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q.to(dtype), k) * scale
    p = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return torch.einsum("bhs,bshd->bhd", p, v).to(q.dtype)
