"""The CUDA GEMM's instances built with nvcc, as tests/qerl/nvfp4/test_cuda_gemm.py and the probe's ceiling kernels
(tests/tools/benchmarks/probes/test_gemm_cuda.py) check them."""

from __future__ import annotations

import subprocess

from qerl.nvfp4 import cuda_gemm


def _nvcc_build(out_dir, arch, instances, extra_source="", params="Args"):
    """The instances built with nvcc (NVRTC builds them the same way on the GPU): ptxas's report and the cubin.
    `extra_source` follows decode_gemm.cu, as cuda_gemm._kernel appends it."""
    src = out_dir / "instances.cu"
    src.write_text(
        f'#include "{cuda_gemm.SOURCE}"\n'
        + extra_source
        + "".join(f"template __global__ void {i}({params});\n" for i in instances)
    )
    cubin = out_dir / "k.cubin"
    report = subprocess.run(
        ["nvcc", "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-o", str(cubin), str(src)],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    return report, cubin
