"""The Triton NVFP4 kernels (qerl/nvfp4/triton_kernels.py): dequant bit-exact with the codec, fused GEMM (split-K,
a LoRA in the same launch) against a float64 reference.

  * CPU, TRITON_INTERPRET=1: the kernels themselves on small odd shapes, and the public ops on top of them. The
    interpreter flag is read when triton is imported, so those run in a subprocess (this file run as a script).
  * GPU (marked `gpu`): real shapes, the inline-asm decode, the TMA and plain-load paths.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import run_under_interpreter
from nvfp4_weights import _bits, _check_linear_and_input_grad, _reference, _rel_err, _weight
from seeds import seed_torch

from qerl.nvfp4 import codec, ops

# ------------------------------------------------------------------------------------ CPU, interpreter


def _interpreter_checks():
    """The Triton kernels under TRITON_INTERPRET=1 (run in a subprocess; see test_triton_interpreter)."""
    from qerl.nvfp4 import triton_kernels as tk

    assert tk.INTERPRET and ops._tk is tk
    seed_torch()  # the subprocess's output is shown when the test fails
    # Dequant: odd N, K/2 not a multiple of the tile, every output dtype, output poisoned beforehand.
    for n, k in ((37, 96), (5, 16)):
        q = _weight(n, k)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            out = torch.full((n, k), float("nan"), dtype=dtype)
            tk.dequantize(q.packed, q.scale, q.global_scale, dtype, out=out, block_n=16, block_k2=32)
            ref = codec.dequantize(q.packed, q.scale, q.global_scale, dtype)
            assert torch.equal(_bits(out), _bits(ref)), (n, k, dtype)
    # Special codes: every byte value and scales across the fp8 range (subnormals included).
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    scale = torch.tensor([1, 7, 8, 100, 126, 0x38, 0x40, 0x7E] * 4, dtype=torch.uint8).reshape(16, 2)
    scale = scale.view(torch.float8_e4m3fn)
    gs = torch.tensor([3.7], dtype=torch.float32)
    out = tk.dequantize(packed, scale, gs, torch.bfloat16)
    assert torch.equal(_bits(out), _bits(codec.dequantize(packed, scale, gs, torch.bfloat16)))

    # Fused GEMM: odd M and N, K with a partial tile, split-K, bias, fp16 and bf16 activations.
    n, k = 45, 160
    q = _weight(n, k)
    cases = (  # (M, split, dtype, bias, BLOCK_M)
        (1, 1, torch.bfloat16, False, 16),
        (5, 2, torch.bfloat16, True, 16),
        (7, 3, torch.float16, True, 16),
        (19, 3, torch.float16, False, 32),
        (33, 1, torch.bfloat16, True, 64),
    )
    for m, split, dtype, with_bias, block_m in cases:
        x = torch.randn(m, k, dtype=dtype)
        b = torch.randn(n, dtype=dtype) if with_bias else None
        y = torch.full((m, n), float("nan"), dtype=dtype)
        cfg = tk.GemmConfig(block_m, 16, 64, split, 4, 2)
        tk.gemm(x, q.packed, q.scale, q.global_scale, bias=b, out=y, config=cfg)
        assert not y.isnan().any()
        e = _rel_err(y, _reference(x, q, b))
        assert e < 1e-2, (m, split, dtype, e)
        # Calls with kept split-K counters give the same answer and leave the counters zeroed for the next one.
        counters = torch.zeros(2 - (-n // 16), dtype=torch.int32)  # two LoRA counters, then one per 16-row N tile
        for _ in range(2):
            y2 = tk.gemm(x, q.packed, q.scale, q.global_scale, bias=b, config=cfg, counters=counters)
            assert torch.equal(y2, y) and not counters.any()

    # A LoRA adapter in the same launch (the native rollout engine's path): its shrink programs and the N tiles'
    # epilogues, with and without split-K, fp16 and bf16, twice on kept counters (the kernel re-arms them), and the
    # large-M fallback that adds it after the GEMM. The shrink is rounded to x's dtype once, as a separate GEMM would.
    for m, split, dtype in (
        (3, 1, torch.bfloat16),
        (6, 3, torch.bfloat16),
        (5, 2, torch.float16),
        (ops.FUSED_MAX_M + 1, 1, torch.bfloat16),
    ):
        x = torch.randn(m, k, dtype=dtype)
        b = torch.randn(n, dtype=dtype)
        lora_a, lora_b = torch.randn(32, k, dtype=dtype) * 0.1, torch.randn(n, 32, dtype=dtype) * 0.1
        shrink = (x.double() @ lora_a.double().t()).to(dtype).double()
        expected = _reference(x, q, b) + shrink @ lora_b.double().t()
        if m <= ops.FUSED_MAX_M:
            counters = ops.splitk_counters(n)
            for _ in range(2):
                y = torch.full((m, n), float("nan"), dtype=dtype)
                tk.gemm(
                    x,
                    q.packed,
                    q.scale,
                    q.global_scale,
                    bias=b,
                    out=y,
                    counters=counters,
                    config=tk.GemmConfig(16, 16, 64, split, 4, 2),
                    lora=(lora_a, lora_b),
                )
                assert not y.isnan().any() and not counters.any(), (m, split)
                assert _rel_err(y, expected) < 1e-2, (m, split, dtype)
        y = ops.nvfp4_linear_lora(x, q.packed, q.scale, q.global_scale, b, None, lora_a, lora_b)
        assert _rel_err(y, expected) < 1e-2, m
    with pytest.raises(ValueError, match="power of two"):
        tk.gemm(x[:2], q.packed, q.scale, q.global_scale, lora=(lora_a[:12], lora_b[:, :12]))

    # Public API under the interpreter: small M takes the fused kernel, large M dequant + matmul; grads.
    q = _weight(24, 64)
    for m in (3, ops.FUSED_MAX_M + 1):
        _check_linear_and_input_grad(q, torch.randn(m, 64, dtype=torch.bfloat16, requires_grad=True))
        with torch.no_grad():  # the eager fast path (no op dispatch) computes exactly what the op does
            x = torch.randn(2, m, 64, dtype=torch.bfloat16)
            op = torch.ops.qerl.nvfp4_linear(x, q.packed, q.scale, q.global_scale, None, None)
            assert torch.equal(ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale), op)
    print("interpreter checks passed")


def test_triton_interpreter():
    run_under_interpreter(__file__)


# ------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (1037, 3632), (40, 27648)])
def test_gpu_dequant_bit_exact(seed, n, k):
    from qerl.nvfp4 import triton_kernels as tk

    q = _weight(n, k, "cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = torch.full((n, k), float("nan"), device="cuda", dtype=dtype)
        tk.dequantize(q.packed, q.scale, q.global_scale, dtype, out=out)
        assert torch.equal(_bits(out), _bits(codec.dequantize(q.packed, q.scale, q.global_scale, dtype)))


@gpu
@pytest.mark.parametrize("use_asm", [True, False])
@pytest.mark.parametrize("m", [1, 3, 16, 17, 50, 64])
def test_gpu_gemm_matches_float64(seed, m, use_asm):
    from qerl.nvfp4 import triton_kernels as tk

    n, k = 1037, (3632 if m % 2 else 3584)  # odd N; K % 256 != 0 takes the plain-load path, else TMA
    q = _weight(n, k, "cuda")
    x = torch.randn(m + 1, k, device="cuda", dtype=torch.bfloat16)[1:]  # misaligned rows: the kernel copies x
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = _reference(x, q, b)
    base = tk.default_config(m, n, k, x.device)
    bm = max(16, 1 << (m - 1).bit_length())
    configs = {
        base,
        tk.GemmConfig(bm, 64, 256, 1, 4, 4),
        tk.GemmConfig(bm, 128, 128, 5, 8, 3),
        tk.GemmConfig(bm, 64, 128, 3, 4, 4),
        tk.GemmConfig(bm, 64, 256, 2, 4, 2),
    }
    counters = ops.splitk_counters(n, "cuda")
    for cfg in configs:
        for _ in range(2):  # the second call runs on the counters the first left behind
            y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            tk.gemm(x, q.packed, q.scale, q.global_scale, bias=b, out=y, config=cfg, use_asm=use_asm, counters=counters)
            assert not y.isnan().any()
            assert _rel_err(y, ref) < 1e-2, cfg
            assert not counters.any()


@gpu
@pytest.mark.parametrize("rank", [16, 32, 64])
@pytest.mark.parametrize("m", [1, 8, 16, 64])
def test_gpu_gemm_lora_in_the_same_launch(seed, m, rank):
    """The rollout engine's projection: a LoRA's shrink programs and the N tiles' epilogues in one launch, on the
    default (split-K) config and forced splits, the TMA and plain-load paths, twice on kept counters."""
    from qerl.nvfp4 import triton_kernels as tk

    for n, k in ((1037, 3584), (4608, 3632)):
        q = _weight(n, k, "cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        lora_a = torch.randn(rank, k, device="cuda", dtype=torch.bfloat16) * 0.05
        lora_b = torch.randn(n, rank, device="cuda", dtype=torch.bfloat16) * 0.05
        shrink = (x.double() @ lora_a.double().t()).to(torch.bfloat16).double()
        ref = _reference(x, q) + shrink @ lora_b.double().t()
        counters = ops.splitk_counters(n, "cuda")
        base = tk.default_config(m, n, k, x.device)
        splits = {base.split_k, 1, 5}
        for cfg in (
            tk.GemmConfig(base.block_m, base.block_n, base.block_k, s, base.num_warps, base.num_stages) for s in splits
        ):
            for _ in range(2):
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                tk.gemm(
                    x, q.packed, q.scale, q.global_scale, out=y, config=cfg, counters=counters, lora=(lora_a, lora_b)
                )
                torch.cuda.synchronize()
                assert not y.isnan().any() and not counters.any(), cfg
                assert _rel_err(y, ref) < 1e-2, cfg


if __name__ == "__main__":
    _interpreter_checks()
