"""The native engine's elementwise steps, each one kernel: residual add + RMSNorm, rotary + KV-cache write,
SiLU or GELU-tanh gate. Under a CUDA graph every launch costs ~2 us whatever it does, so these fuse what eager
PyTorch runs as 5-15 kernels each.

Every kernel computes in FP32 and rounds its output once to the activation dtype (the trainer's FP32-master norms
do the same through norms.FP32Compute). Each has a plain-torch twin used on CPU (without TRITON_INTERPRET) and
by the tests as the reference.
"""

from __future__ import annotations

import torch

from qerl.dependent_launch import pdl_enabled
from qerl.device_facts import INTERPRET, triton_runs_on
from qerl.rollout.native import kv_cache

try:  # Triton is Linux-only; the torch twins keep the engine working without it.
    import triton
    import triton.language as tl

    from qerl.dependent_launch import let_next_kernel_launch, wait_for_previous_kernel
except ImportError:  # pragma: no cover - depends on the platform
    triton = None


# ---------------------------------------------------------------------------------------- residual + RMSNorm


def rmsnorm_torch(x, weight, eps, residual=None, unit_offset=False):
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (weight.float() + 1.0 if unit_offset else weight.float())).to(x.dtype)


if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        n,
        eps,
        HAS_RES: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        # The norm's scale changes only between rounds (refresh, AQN), never by a kernel of the step: read before the
        # wait, its round trip overlaps the previous kernel's tail instead of following the row's reduction.
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            w = w + 1.0
        wait_for_previous_kernel(PDL)
        let_next_kernel_launch(PDL)  # one wave of programs
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_RES:  # the residual stream is updated in place: h = bf16(h + x), as a BF16 add rounds
            x = tl.load(res_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)
            x = x.to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        tl.store(out_ptr + row * n + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, unit_offset: bool = False
) -> torch.Tensor:
    """RMSNorm(x) * weight for x [M, H] (weight in any float dtype, applied in FP32), or RMSNorm(x) * (1 + weight)
    with `unit_offset` (Gemma's norms, 1 + w in FP32 as transformers computes it). With `residual`, first
    residual += x in place and normalize the sum (the decoder's pre-norm residual stream)."""
    if not triton_runs_on(x):
        return rmsnorm_torch(x, weight, eps, residual, unit_offset)
    m, n = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    pdl = pdl_enabled(x.device)
    _rmsnorm_kernel[(m,)](
        x,
        res,
        weight,
        out,
        n,
        eps,
        HAS_RES=residual is not None,
        UNIT_OFFSET=unit_offset,
        BLOCK=triton.next_power_of_2(n),
        PDL=pdl,
        num_warps=8 if n >= 4096 else 4,
        launch_pdl=pdl,
    )
    return out


# ------------------------------------------------------------------------------------ rotary + KV-cache write


def qk_rmsnorm(qkv: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of the queries and keys in the fused projection qkv [M, (Hq + 2 Hkv) * D] (Qwen3, Gemma-3:
    before rotary), by scale [Hq + Hkv, D] (a row per query head, then per key head), as transformers computes it:
    normalized in FP32, then a scale in qkv's dtype (Qwen3) rounds the normalized heads first and multiplies in
    that dtype, an FP32 scale (Gemma-3's 1 + w) multiplies in FP32 and rounds once. Returns a new qkv; the values
    pass through. Plain torch: a few small kernels per layer, and no host sync (CUDA-graph safe)."""
    normed_heads, d = scale.shape
    heads = qkv.view(qkv.shape[0], -1, d)
    qk = heads[:, :normed_heads].float()
    normed = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps)
    if scale.dtype != torch.float32:
        normed = normed.to(qkv.dtype)
    return torch.cat([(normed * scale).to(qkv.dtype), heads[:, normed_heads:]], dim=1).view(qkv.shape)


def rope_cache_torch(
    qkv, cos, sin, batch_idx, positions, k_cache, v_cache, num_heads, num_kv_heads, k_scale=None, v_scale=None
):
    m = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = qkv.float().split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    c, s = cos[positions].float()[:, None], sin[positions].float()[:, None]

    def rotate(t, heads):
        t = t.reshape(m, heads, d)
        t1, t2 = t[..., : d // 2], t[..., d // 2 :]
        return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1)

    idx = (batch_idx.long(), positions.long())
    keys, values = rotate(k, num_kv_heads), v.reshape(m, num_kv_heads, d)
    for cache, scale, rows in ((k_cache, k_scale, keys), (v_cache, v_scale, values)):
        if cache.dtype == kv_cache.FP8:
            cache[idx], scale[idx] = kv_cache.quantize_reference(rows)
        else:
            cache[idx] = rows.to(cache.dtype)
    return rotate(q, num_heads).to(qkv.dtype)


if triton is not None:

    @triton.jit
    def _store_kv(ptrs, x, mask, FP8: tl.constexpr, INTERPRET: tl.constexpr):
        """FP32 x into the cache at ptrs: as E4M3 codes (x already divided by its scale), or in the cache's dtype."""
        if FP8:
            tl.store(ptrs, kv_cache.to_e4m3_bits(x, INTERPRET), mask=mask)
        else:
            tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["stride_sb"])  # the FP8 scales' batch stride follows the KV capacity
    def _rope_cache_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        bidx_ptr,
        pos_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        ks_ptr,
        vs_ptr,
        stride_cb,
        stride_cs,
        stride_sb,
        stride_ss,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        FP8: tl.constexpr,
        PDL: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        tok = tl.program_id(0)
        # Where the token goes and its rotation are not written by the kernel before this one (the qkv GEMM): read
        # before the wait, so only qkv's own load follows it.
        b = tl.load(bidx_ptr + tok).to(tl.int64)
        p = tl.load(pos_ptr + tok).to(tl.int64)
        half = tl.arange(0, D // 2)
        c = tl.load(cos_ptr + p * (D // 2) + half)[None, :]
        s = tl.load(sin_ptr + p * (D // 2) + half)[None, :]
        wait_for_previous_kernel(PDL)
        let_next_kernel_launch(PDL)  # one wave of programs
        heads = tl.arange(0, BLOCK_H)[:, None]
        row = qkv_ptr + tok * (HQ + 2 * HKV) * D
        # q heads -> rotated into q_out; k heads -> rotated into the cache; v heads -> copied into the cache.
        qm = heads < HQ
        q1 = tl.load(row + heads * D + half[None, :], mask=qm, other=0.0).to(tl.float32)
        q2 = tl.load(row + heads * D + D // 2 + half[None, :], mask=qm, other=0.0).to(tl.float32)
        q_out = q_ptr + tok * HQ * D + heads * D
        tl.store(q_out + half[None, :], (q1 * c - q2 * s).to(q_ptr.dtype.element_ty), mask=qm)
        tl.store(q_out + D // 2 + half[None, :], (q2 * c + q1 * s).to(q_ptr.dtype.element_ty), mask=qm)
        km = heads < HKV
        k1 = tl.load(row + (HQ + heads) * D + half[None, :], mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(row + (HQ + heads) * D + D // 2 + half[None, :], mask=km, other=0.0).to(tl.float32)
        k1, k2 = k1 * c - k2 * s, k2 * c + k1 * s
        dims = tl.arange(0, D)[None, :]
        v = tl.load(row + (HQ + HKV + heads) * D + dims, mask=km, other=0.0).to(tl.float32)
        slot = b * stride_cb + p * stride_cs + heads * D
        if FP8:  # one scale per head row: amax over its D values, then scaled into E4M3's range
            scale_slot = b * stride_sb + p * stride_ss + tl.arange(0, BLOCK_H)
            k_scale, k_inverse = kv_cache.fp8_scales(tl.maximum(tl.max(tl.abs(k1), 1), tl.max(tl.abs(k2), 1)))
            v_scale, v_inverse = kv_cache.fp8_scales(tl.max(tl.abs(v), 1))
            tl.store(ks_ptr + scale_slot, k_scale, mask=tl.arange(0, BLOCK_H) < HKV)
            tl.store(vs_ptr + scale_slot, v_scale, mask=tl.arange(0, BLOCK_H) < HKV)
            k1, k2, v = k1 * k_inverse[:, None], k2 * k_inverse[:, None], v * v_inverse[:, None]
        _store_kv(kc_ptr + slot + half[None, :], k1, km, FP8, INTERPRET)
        _store_kv(kc_ptr + slot + D // 2 + half[None, :], k2, km, FP8, INTERPRET)
        _store_kv(vc_ptr + slot + dims, v, km, FP8, INTERPRET)


def rope_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch_idx: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding (rotate-half convention, tables cos/sin [positions, D/2] in FP32) of the fused projection
    qkv [M, (Hq + 2 Hkv) * D]: returns the rotated queries [M, Hq, D] and writes the rotated keys and the values
    of token i into k_cache/v_cache [B, S, Hkv, D] at (batch_idx[i], positions[i]). FP8 caches (E4M3) take their
    scales k_scale/v_scale [B, S, Hkv] FP32 (kv_cache.quantize_reference's format). With PDL, cos, sin, batch_idx
    and positions are read before the wait: the kernel launched just before this one must not write them."""
    fp8 = k_cache.dtype == kv_cache.FP8
    if fp8:
        kv_cache.check_scales(k_cache, k_scale, v_scale)
    if not triton_runs_on(qkv):
        return rope_cache_torch(
            qkv, cos, sin, batch_idx, positions, k_cache, v_cache, num_heads, num_kv_heads, k_scale, v_scale
        )
    m = qkv.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty((m, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    pdl = pdl_enabled(qkv.device)
    if fp8:  # the kernel stores the codes as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = k_cache  # not read
    _rope_cache_kernel[(m,)](
        qkv,
        cos,
        sin,
        batch_idx,
        positions,
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        k_cache.stride(0),
        k_cache.stride(1),
        k_scale.stride(0) if fp8 else 0,
        k_scale.stride(1) if fp8 else 0,
        HQ=num_heads,
        HKV=num_kv_heads,
        D=d,
        BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)),
        FP8=fp8,
        PDL=pdl,
        INTERPRET=INTERPRET,
        num_warps=4,
        launch_pdl=pdl,
    )
    return q


# ---------------------------------------------------------------------------------------- SiLU / GELU-tanh gate


def silu_mul_torch(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def gelu_tanh_mul_torch(gate_up):
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


if triton is not None:

    @triton.jit
    def _gate_mul_kernel(gu_ptr, out_ptr, n, GELU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        let_next_kernel_launch(PDL)  # one wave of programs
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(gu_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
        # GELU-tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3))) = g * sigmoid(2c (...)), c = sqrt(2 / pi)
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g) if GELU else g
        tl.store(out_ptr + row * n + cols, (g / (1.0 + tl.exp(-z)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def _gate_mul(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    m, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    pdl = pdl_enabled(gate_up.device)
    _gate_mul_kernel[(m, triton.cdiv(n, block))](
        gate_up, out, n, GELU=gelu, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the fused projection [M, 2I] (gate first) -> [M, I]."""
    return _gate_mul(gate_up, gelu=False) if triton_runs_on(gate_up) else silu_mul_torch(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU-tanh(gate) * up (Gemma's gelu_pytorch_tanh) of the fused projection [M, 2I] (gate first) -> [M, I]."""
    return _gate_mul(gate_up, gelu=True) if triton_runs_on(gate_up) else gelu_tanh_mul_torch(gate_up)
