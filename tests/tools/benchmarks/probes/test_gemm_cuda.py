"""benchmarks/probes/gemm_cuda.py's wgmma-ceiling kernels build as the CUDA GEMM they time does (nvcc, on the CPU)."""

from __future__ import annotations

import re
import shutil

import pytest
from nvcc import _nvcc_build


def test_wgmma_ceiling_probe_builds_unserialized(tmp_path):
    """benchmarks/probes/gemm.cu's wgmma-ceiling kernels time the wgmma kernel's chunk loop: they must build the way it
    does, with no wgmma serialized and no spills, or they would time something else."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here (NVRTC builds the kernel on the GPU)")
    from benchmarks.probes.gemm_cuda import CEILING_LDG_SOURCES, CEILING_SOURCE, CEILING_STAGES

    for instances, params in (
        ([f"wgmma_ceiling<{s}, {w}>" for s in range(len(CEILING_STAGES)) for w in (1, 2, 3, 4)], "CeilingArgs"),
        ([f"wgmma_ceiling_ldg<{s}, {w}, {r}>" for s, r, _ in CEILING_LDG_SOURCES for w in (1, 4)], "CeilingLdgArgs"),
    ):
        report, _ = _nvcc_build(tmp_path, "sm_90a", instances, CEILING_SOURCE.read_text(), params)
        assert "Potential Performance Loss" not in report, report
        spills = re.findall(r"(\d+) bytes spill stores", report)
        assert len(spills) == len(instances) and all(s == "0" for s in spills), report
