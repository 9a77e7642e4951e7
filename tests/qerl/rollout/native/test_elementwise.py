"""The native engine's fused elementwise kernels (qerl/rollout/native/elementwise.py) against their plain-torch twins,
under the Triton interpreter on the CPU (GPU: exercised through test_engine_gpu.py)."""

import torch
from interpreter import run_under_interpreter
from seeds import seed_torch

from qerl.rollout.native import elementwise, kv_cache

# Two BF16 ulps: the interpreter truncates FP32 -> BF16 where the GPU rounds to nearest, and the residual's
# rounding feeds the norm.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _interpreter_checks():
    assert elementwise.INTERPRET
    seed_torch()  # the subprocess's output is shown when the test fails
    bf16 = torch.bfloat16

    # Residual add + RMSNorm, FP32 scale, hidden not a power of two; the residual is updated in place.
    x, res = torch.randn(5, 96, dtype=bf16), torch.randn(5, 96, dtype=bf16)
    w, eps = torch.rand(96) + 0.5, 1e-6
    res_ref = res.clone()
    out = elementwise.rmsnorm(x, w, eps, residual=res)
    ref = elementwise.rmsnorm_torch(x, w, eps, residual=res_ref)
    torch.testing.assert_close(res.float(), res_ref.float(), **BF16_TOL)
    assert not torch.equal(res, res_ref.new_zeros(res.shape))
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)
    torch.testing.assert_close(
        elementwise.rmsnorm(x, w, eps).float(), elementwise.rmsnorm_torch(x, w, eps).float(), **BF16_TOL
    )
    # Gemma's (1 + w) scale, w around zero as its checkpoints hold it.
    w0 = torch.randn(96) * 0.3
    torch.testing.assert_close(
        elementwise.rmsnorm(x, w0, eps, unit_offset=True).float(),
        elementwise.rmsnorm_torch(x, w0, eps, unit_offset=True).float(),
        **BF16_TOL,
    )

    # Rotary + KV-cache write: GQA 3:1, rows of different sequences and positions, the rest of the cache untouched.
    hq, hkv, d, batch, cap = 6, 2, 16, 3, 10
    qkv = torch.randn(4, (hq + 2 * hkv) * d, dtype=bf16)
    angles = torch.rand(cap, d // 2) * 3
    cos, sin = angles.cos(), angles.sin()
    batch_idx = torch.tensor([0, 2, 2, 1], dtype=torch.int32)
    positions = torch.tensor([0, 3, 9, 5], dtype=torch.int32)
    caches = [torch.full((batch, cap, hkv, d), float("nan"), dtype=bf16) for _ in range(4)]
    q = elementwise.rope_cache(qkv, cos, sin, batch_idx, positions, caches[0], caches[1], hq, hkv)
    q_ref = elementwise.rope_cache_torch(qkv, cos, sin, batch_idx, positions, caches[2], caches[3], hq, hkv)
    torch.testing.assert_close(q.float(), q_ref.float(), **BF16_TOL)
    for ours, theirs in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(ours.isnan(), theirs.isnan())  # the same slots written, no other
        written = ~ours.isnan()
        torch.testing.assert_close(ours[written].float(), theirs[written].float(), **BF16_TOL)

    # The same write into FP8 caches: codes and scales bit-exact with the torch twin (both round the FP32 rotated
    # keys and the values once, the scales are powers of two), every other slot untouched.
    fp8 = [torch.zeros((batch, cap, hkv, d), dtype=kv_cache.FP8) for _ in range(4)]
    scales = [torch.full((batch, cap, hkv), float("nan")) for _ in range(4)]
    qkv[1, hq * d : (hq + 1) * d] = 0  # a key head of zeros: scale of the smallest exponent, codes 0
    q = elementwise.rope_cache(qkv, cos, sin, batch_idx, positions, fp8[0], fp8[1], hq, hkv, scales[0], scales[1])
    q_ref = elementwise.rope_cache_torch(
        qkv, cos, sin, batch_idx, positions, fp8[2], fp8[3], hq, hkv, scales[2], scales[3]
    )
    torch.testing.assert_close(q.float(), q_ref.float(), **BF16_TOL)
    for ours, theirs in ((0, 2), (1, 3)):
        assert torch.equal(fp8[ours].view(torch.uint8), fp8[theirs].view(torch.uint8))
        assert torch.equal(scales[ours].nan_to_num(-1), scales[theirs].nan_to_num(-1))
    assert scales[0].isnan().sum() == (batch * cap - len(positions)) * hkv

    # The E4M3 encoder itself on every code's value, the midpoints between neighbours (ties to even), subnormals,
    # signed zeros and random values, against torch's cast.
    codes = torch.arange(256, dtype=torch.uint8).view(kv_cache.FP8).float()
    grid = codes[codes.isfinite() & (codes.abs() < 256)].unique()
    x = torch.cat(
        [
            grid,
            (grid[1:] + grid[:-1]) / 2,
            torch.tensor([-0.0, 2.0**-10, 3 * 2.0**-11, 1e-30]),
            (torch.rand(4096) * 2 - 1) * 255.9,
            torch.randn(512) * 1e-3,
        ]
    )
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _encode_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    assert torch.equal(out, x.to(kv_cache.FP8).view(torch.uint8))

    # SiLU gate, width not a multiple of the block.
    gate_up = torch.randn(3, 2 * 1100, dtype=bf16)
    torch.testing.assert_close(
        elementwise.silu_mul(gate_up).float(), elementwise.silu_mul_torch(gate_up).float(), **BF16_TOL
    )
    gate_up = torch.cat([torch.randn(3, 1100) * 4, torch.randn(3, 1100)], -1).to(bf16)  # gates far into the tails
    torch.testing.assert_close(
        elementwise.gelu_tanh_mul(gate_up).float(), elementwise.gelu_tanh_mul_torch(gate_up).float(), **BF16_TOL
    )
    print("interpreter checks passed")


if elementwise.INTERPRET:
    import triton
    import triton.language as tl

    @triton.jit
    def _encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        tl.store(out_ptr + r, kv_cache.to_e4m3_bits(tl.load(x_ptr + r, mask=r < n), True), mask=r < n)


def test_triton_interpreter():
    run_under_interpreter(__file__)


def test_torch_twins_are_the_math():
    """The twins (the CPU path and the references above) against the formulas in float64. The twins compute in
    FP32 by design (as the kernels do), so they are held to FP32 rounding, not float64's default tolerance."""
    fp32 = dict(rtol=1e-5, atol=1e-6)
    x = torch.randn(4, 32, dtype=torch.float64)
    w = torch.rand(32, dtype=torch.float64)
    expected = x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w
    torch.testing.assert_close(elementwise.rmsnorm_torch(x, w, 1e-5), expected, **fp32)
    torch.testing.assert_close(elementwise.rmsnorm_torch(x, w - 1, 1e-5, unit_offset=True), expected, **fp32)
    gate, up = torch.randn(2, 8, dtype=torch.float64), torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(
        elementwise.silu_mul_torch(torch.cat([gate, up], -1)), gate * torch.sigmoid(gate) * up, **fp32
    )
    g = gate
    gelu_tanh = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)))
    torch.testing.assert_close(elementwise.gelu_tanh_mul_torch(torch.cat([gate, up], -1)), gelu_tanh * up, **fp32)
    # Per-head norms: Qwen3's scale in the activations' dtype, Gemma-3's (1 + w) in FP32, the same math.
    qkv = torch.randn(3, 4 * 8, dtype=torch.float64)  # 2 query heads, 1 key head, 1 value head of 8
    scale = torch.rand(3, 8, dtype=torch.float64)
    heads = qkv.view(3, 4, 8)
    normed = heads[:, :3] / (heads[:, :3].pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * scale
    for s in (scale, scale.float()):
        out = elementwise.qk_rmsnorm(qkv, s, 1e-6).view(3, 4, 8)
        torch.testing.assert_close(out[:, :3], normed, **fp32)
        assert torch.equal(out[:, 3], heads[:, 3])
    # Rotary of one head at position p: each (x_i, x_{i+D/2}) pair turned by angle p * theta_i.
    d, p = 8, 3
    theta = torch.rand(d // 2, dtype=torch.float64)
    qkv = torch.randn(1, 3 * d, dtype=torch.float64)
    cache = [torch.zeros(1, 5, 1, d, dtype=torch.float64) for _ in range(2)]
    pos = torch.tensor([p])
    angle = (pos[:, None] * theta).expand(5, -1)  # every row of the table: position p's angles
    q = elementwise.rope_cache_torch(qkv, angle.cos(), angle.sin(), torch.tensor([0]), pos, cache[0], cache[1], 1, 1)[
        0, 0
    ]
    x1, x2 = qkv[0, : d // 2], qkv[0, d // 2 : d]
    c, s = (p * theta).cos(), (p * theta).sin()
    torch.testing.assert_close(q, torch.cat([x1 * c - x2 * s, x2 * c + x1 * s]), **fp32)
    torch.testing.assert_close(cache[1][0, p, 0], qkv[0, 2 * d :], **fp32)


if __name__ == "__main__":
    _interpreter_checks()
