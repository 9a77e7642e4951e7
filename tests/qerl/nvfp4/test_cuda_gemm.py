"""The CUDA GEMMs (qerl/nvfp4/decode_gemm.cu: mma.sync for 1-16 rows, wgmma for 17-64) against float64 references, on
the GPU; their build, on CPU.

  * CPU: the source builds for sm_90 / sm_90a with nvcc where one is installed (NVRTC builds it the same way on the
    GPU), with no register spills in the decode instances the dispatch picks, no wgmma serialized by ptxas, and no x
    load above the PDL wait in their SASS; the dispatch refuses what the kernels cannot take.
  * GPU: real and odd shapes, 1-64 rows, every tile / warp / ring / split variant, bias, a LoRA in the same launch,
    the split-K and LoRA counters left as they were across calls, CUDA-graph replay bit-equal to eager.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from nvcc import _nvcc_build

from qerl.nvfp4 import codec, cuda_gemm, ops


def _weight(n, k, device):
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.05
    w[min(3, n - 1), :16] = 0  # an all-zero group: the smallest FP8 scale
    return codec.quantize(w)


def _reference(x, q, bias=None, lora=None):
    """float64 x @ W^T (+ b) (+ bf16(x @ A^T) @ B^T), W the codec's dequantized weight."""
    y = x.double() @ codec.dequantize(q.packed, q.scale, q.global_scale, torch.float32).double().t()
    if bias is not None:
        y += bias.double()
    if lora is not None:
        a, b = lora
        y += (x.double() @ a.double().t()).to(torch.bfloat16).double() @ b.double().t()
    return y


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------------------------ CPU


INSTANCES = sorted({(2, mt, w, 2, 1) for mt in (1, 2) for w in (4, 8)})  # what default_config picks
WGMMA_INSTANCES = [(8, 2, 2, 1), (8, 2, 3, 2)]  # what wgmma_config picks


@pytest.fixture(scope="module")
def sm90_build(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here (NVRTC builds the kernel on the GPU)")
    return _nvcc_build(
        tmp_path_factory.mktemp("sm90"),
        "sm_90",
        [f"nvfp4_decode_gemm<{a}, {b}, {c}, {d}, {e}>" for a, b, c, d, e in INSTANCES],
    )


@pytest.fixture(scope="module")
def sm90a_build(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here (NVRTC builds the kernel on the GPU)")
    return _nvcc_build(
        tmp_path_factory.mktemp("sm90a"),
        "sm_90a",
        [f"nvfp4_wgmma_gemm<{a}, {b}, {c}, {d}>" for a, b, c, d in WGMMA_INSTANCES],
    )


def test_builds_for_sm90_without_spills(sm90_build):
    report, _ = sm90_build
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == len(INSTANCES) and all(s == "0" for s in spills), report


def test_wgmma_kernel_builds_unserialized(sm90a_build):
    """ptxas serializes every wgmma (a wait after each, C7513/C7515) when it cannot prove the A registers and
    accumulators untouched while one is in flight; the kernel's keep_until_here and per-chunk wait prevent it."""
    report, _ = sm90a_build
    assert "Potential Performance Loss" not in report, report
    assert len(re.findall(r"Used (\d+) registers", report)) == len(WGMMA_INSTANCES)


def _cuobjdump():
    """cuobjdump from the CUDA toolkit, or the copy Triton ships."""
    found = shutil.which("cuobjdump")
    if found is None:
        try:
            import triton
        except ImportError:
            return None
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        found = str(bundled) if bundled.exists() else None
    return found


def x_loads_above_the_wait(sass: str) -> list[str]:
    """16-byte global loads that are not the weight stream's (`.NA`: L1 no-allocate), i.e. x or LoRA A rows, which
    other kernels write, reached before the path's griddepcontrol.wait (SASS `ACQBULK`). A path starts at the function
    or after an unpredicated EXIT; the GEMM and the LoRA CTAs each have one wait."""
    bad = []
    for function in sass.split("Function : ")[1:]:
        waited = False
        for line in function.splitlines():
            m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
            if not m:
                continue
            op = m.group(1)
            if op == "EXIT":
                waited = False
            elif op == "ACQBULK":
                waited = True
            elif re.search(r"\bLDG\.E(?![.\w]*\.NA\b)[.\w]*\.128\b", op) and not waited:
                bad.append(f"{function.split()[0]}: {op}")
    return bad


def _sass(cubin):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump here")
    return subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def test_x_is_read_only_after_the_pdl_wait(sm90_build):
    """The weight loads may run ahead of griddepcontrol.wait, x must not: with PDL the previous kernel may still be
    writing it (a hoisted x load once made CUDA-graph decode sample NaN log-probs). Checked in the SASS, with the
    trigger that lets the next kernel start. The source before the fix (commit 74da21c) fails this check: 24 x loads
    above the wait across these 4 instances."""
    sass = _sass(sm90_build[1])
    assert sass.count("ACQBULK") == 2 * len(INSTANCES)  # the GEMM's wait and the LoRA CTAs'
    assert not x_loads_above_the_wait(sass)
    # griddepcontrol.launch_dependents (PREEXIT) after the main loop: without it the next kernel of the decode step
    # cannot start early (a lost one once cost 3% of the 7B step and 5% per GEMM call without failing any test).
    assert sass.count("PREEXIT") == len(INSTANCES)


def test_wgmma_kernel_reads_x_only_after_the_pdl_wait(sm90a_build):
    sass = _sass(sm90a_build[1])
    assert sass.count("ACQBULK") == 2 * len(WGMMA_INSTANCES)  # the GEMM's wait and the LoRA CTAs'
    assert not x_loads_above_the_wait(sass)
    assert sass.count("PREEXIT") == len(WGMMA_INSTANCES)
    assert sass.count("HGMMA.64x64x16.F32.BF16") >= 8 * len(WGMMA_INSTANCES)  # a chunk's 8 k16 steps


def test_dispatch_refuses_what_the_kernel_cannot_take():
    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    assert not cuda_gemm.supported(x, 256)  # CPU
    if torch.cuda.is_available():
        cuda = torch.zeros(8, 256, dtype=torch.bfloat16, device="cuda")
        assert not cuda_gemm.supported(cuda.half(), 256)
        assert not cuda_gemm.supported(torch.zeros(17, 256, dtype=torch.bfloat16, device="cuda"), 256)  # Triton's
        assert not cuda_gemm.supported(torch.zeros(65, 256, dtype=torch.bfloat16, device="cuda"), 256)
        rows_48 = torch.zeros(48, 256, dtype=torch.bfloat16, device="cuda")
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert cuda_gemm.supported(rows_48, 256) == hopper
        assert cuda_gemm.supported(rows_48, 256, lora_rank=32, n=5120) == hopper
        assert not cuda_gemm.supported(rows_48, 256, lora_rank=64, n=5120)  # there the wgmma kernel's LoRA loses
        assert not cuda_gemm.supported(rows_48, 256, lora_rank=16, n=3584)
        assert not cuda_gemm.supported(cuda[:, :192], 192)  # K % 128


# ------------------------------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.gpu


DECODE_CONFIGS = [
    None,
    cuda_gemm.CudaGemmConfig(32, 4, 2, 1, 0),
    cuda_gemm.CudaGemmConfig(16, 8, 3, 3, 1),
    cuda_gemm.CudaGemmConfig(64, 2, 2, 7, 1),
    cuda_gemm.CudaGemmConfig(32, 8, 2, 2, 1),
]
WGMMA_CONFIGS = [
    None,
    cuda_gemm.WgmmaConfig(1, 2, 1, 4),
    cuda_gemm.WgmmaConfig(2, 3, 3, 2),
    cuda_gemm.WgmmaConfig(2, 2, 5, 1),
    cuda_gemm.WgmmaConfig(1, 3, 2, 2),
]
sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="the wgmma kernel needs sm_90"
)
KERNELS = {  # rows and configs per kernel (None: the dispatch's default config)
    "decode": ((1, 5, 8, 13, 16), DECODE_CONFIGS),
    "wgmma": pytest.param(((17, 33, 61, 64), WGMMA_CONFIGS), marks=sm90),
}


@gpu
@pytest.mark.parametrize("rows_configs", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("n,k", [(1001, 384), (77, 1280), (4608, 3584), (3584, 18944)])
def test_gpu_matches_float64_every_variant(seed, n, k, rows_configs):
    rows, configs = rows_configs
    q = _weight(n, k, "cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    counters = ops.splitk_counters(n, "cuda")
    for m in rows:
        x = torch.randn(m + 1, k, device="cuda", dtype=torch.bfloat16)[1:]  # misaligned rows: the kernel copies x
        for with_bias in (False, True):
            ref = _reference(x, q, bias if with_bias else None)
            for cfg in configs:
                for _ in range(2):  # the second call runs on the counters the first left behind
                    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    cuda_gemm.gemm(
                        x,
                        q.packed,
                        q.scale,
                        q.global_scale,
                        bias if with_bias else None,
                        out=y,
                        counters=counters,
                        config=cfg,
                    )
                    torch.cuda.synchronize()
                    assert not y.isnan().any() and not counters.any(), (m, cfg)
                    assert _rel_err(y, ref) < 4e-3, (m, cfg)


LORA_CASES = {  # rows and a split config per kernel
    "decode": ((1, 8, 16), cuda_gemm.CudaGemmConfig(32, 4, 2, 5, 1)),
    "wgmma": pytest.param(((33, 64), cuda_gemm.WgmmaConfig(2, 2, 5, 2)), marks=sm90),
}


@gpu
@pytest.mark.parametrize("rows_config", LORA_CASES.values(), ids=LORA_CASES.keys())
@pytest.mark.parametrize("rank", [16, 48, 64, 96])  # 96: the s and B fragments in two rounds of loads
def test_gpu_lora_in_the_same_launch(seed, rank, rows_config):
    rows, split_config = rows_config
    for m in rows:
        for n, k in ((1037, 3584), (4608, 640)):
            q = _weight(n, k, "cuda")
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            lora = (
                torch.randn(rank, k, device="cuda", dtype=torch.bfloat16) * 0.05,
                torch.randn(n, rank, device="cuda", dtype=torch.bfloat16) * 0.05,
            )
            bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            ref = _reference(x, q, bias, lora)
            counters = ops.splitk_counters(n, "cuda", lora_rank=rank)
            at_rest = counters.clone()  # zeros, then the s slots' empty marks
            for cfg in (None, split_config):
                for _ in range(2):
                    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    cuda_gemm.gemm(
                        x, q.packed, q.scale, q.global_scale, bias, out=y, counters=counters, lora=lora, config=cfg
                    )
                    torch.cuda.synchronize()
                    assert not y.isnan().any() and torch.equal(counters, at_rest), (m, cfg)
                    assert _rel_err(y, ref) < 4e-3, (m, cfg)


LORA_DISPATCH_CASES = {  # rows, weight shape and rank of a rollout engine's call that the CUDA kernels take
    "decode": (8, 4608, 3584, 64),  # a 7B qkv projection with its fused rank
    "wgmma": pytest.param((64, 5120, 13824, 16), marks=sm90),  # a 14B down projection at batch 64
}


@gpu
@pytest.mark.parametrize("case", LORA_DISPATCH_CASES.values(), ids=LORA_DISPATCH_CASES.keys())
def test_gpu_lora_dispatch_and_graph_replay_equal_eager(seed, case):
    m, n, k, rank = case
    q = _weight(n, k, "cuda")
    counters = ops.splitk_counters(n, "cuda", lora_rank=rank)
    at_rest = counters.clone()
    lora = (
        torch.randn(rank, k, device="cuda", dtype=torch.bfloat16) * 0.05,
        torch.randn(n, rank, device="cuda", dtype=torch.bfloat16) * 0.05,
    )
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert cuda_gemm.supported(x, k, rank, n)

    def step():
        return ops.nvfp4_linear_lora(x, q.packed, q.scale, q.global_scale, None, counters, *lora)

    assert _rel_err(step(), _reference(x, q, lora=lora)) < 4e-3
    _assert_graph_replay_equals_eager(step, x)
    assert torch.equal(counters, at_rest)


def _assert_graph_replay_equals_eager(step, x):
    """`step` captured in a CUDA graph (after a warm-up on a side stream) and replayed on fresh x gives eager's bits."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, step(), rtol=0, atol=0)


@gpu
@sm90
def test_gpu_wgmma_dispatch_and_graph_replay_equal_eager(seed):
    n, k = 4608, 3584
    q = _weight(n, k, "cuda")
    counters = ops.splitk_counters(n, "cuda")
    x = torch.randn(48, k, device="cuda", dtype=torch.bfloat16)
    assert cuda_gemm.supported(x, k)

    def step():
        return ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale, splitk_counters=counters)

    assert _rel_err(step(), _reference(x, q)) < 4e-3
    _assert_graph_replay_equals_eager(step, x)
    assert not counters.any()
