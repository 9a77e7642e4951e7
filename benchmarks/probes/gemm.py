"""Where the fused NVFP4 GEMM's time goes: a driver for Nsight Compute and a pure-streaming probe.

    python -m benchmarks.probes.gemm stream            # bandwidth of the GEMM's TMA access pattern alone
    python -m benchmarks.probes.gemm splits            # every split-K on the shapes where wave count matters
    python -m benchmarks.probes.gemm host              # host time per eager call (what bounds eager decode)
    python -m benchmarks.probes.gemm cuda              # CUDA vs Triton decode GEMM, with the engine's LoRA ranks
    python -m benchmarks.probes.gemm wgmma             # CUDA wgmma vs Triton GEMM and cuBLAS BF16 at 40 and 64 rows
    python -m benchmarks.probes.gemm wgmma-lora        # the same with the rollout engine's LoRA in the same launch
    python -m benchmarks.probes.gemm wgmma-ceiling     # the 64-row wgmma loop, built up part by part
    python -m benchmarks.probes.gemm wgmma-by-k        # the 64-row wgmma GEMM's time against K: fixed cost and slope
    python -m benchmarks.probes.gemm small             # 0.5B/1.5B GEMMs at 8 and 64 rows with LoRA: every CUDA config
    ncu --clock-control none -k regex:_gemm_tc_kernel python -m benchmarks.probes.gemm ncu

This module holds the subcommand table; the probes live by family: benchmarks/probes/gemm_triton.py (`stream`,
`splits`, `host`, `ncu`: the Triton GEMM's access pattern, split-K and launch cost) and benchmarks/probes/gemm_cuda.py
(`cuda` and the `wgmma` modes: the CUDA GEMMs, with the ceiling kernels of benchmarks/probes/gemm.cu).
"""

from __future__ import annotations

import argparse
import importlib


def _probe(name: str, **kwargs):
    """The probe `module:function` of this folder, imported when its mode runs (torch and the kernels with it)."""

    def run():
        module, function = name.split(":")
        getattr(importlib.import_module(f"benchmarks.probes.{module}"), function)(**kwargs)

    return run


MODES = {  # subcommand: the probe it runs, and what that measures (the module docstring's line)
    "stream": (_probe("gemm_triton:stream_probe"), "bandwidth of the GEMM's TMA access pattern alone"),
    "splits": (_probe("gemm_triton:split_sweep"), "every split-K on the shapes where wave count matters"),
    "host": (_probe("gemm_triton:host_cost"), "host time per eager call (what bounds eager decode)"),
    "cuda": (_probe("gemm_cuda:cuda_vs_triton"), "CUDA vs Triton decode GEMM, with the engine's LoRA ranks"),
    "wgmma": (_probe("gemm_cuda:wgmma_vs_triton"), "CUDA wgmma vs Triton GEMM and cuBLAS BF16 at 40 and 64 rows"),
    "wgmma-lora": (
        _probe("gemm_cuda:wgmma_vs_triton", lora=True),
        "the same with the rollout engine's LoRA in the same launch",
    ),
    "wgmma-ceiling": (_probe("gemm_cuda:wgmma_ceiling"), "the 64-row wgmma loop, built up part by part"),
    "wgmma-by-k": (_probe("gemm_cuda:wgmma_by_k"), "the 64-row wgmma GEMM's time against K: fixed cost and slope"),
    "small": (
        _probe("gemm_cuda:small_shapes"),
        "the 0.5B and 1.5B layers' GEMMs at 8 and 64 rows with the engine's LoRA: bytes floor, cuBLAS, dispatch, "
        "Triton, and the CUDA kernel at every config of a grid",
    ),
    "ncu": (
        _probe("gemm_triton:ncu_targets"),
        "the GEMM on a few 7B shapes, untimed, for Nsight Compute to sample: "
        "ncu --clock-control none -k regex:_gemm_tc_kernel python -m benchmarks.probes.gemm ncu",
    ),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)  # a mistyped mode runs nothing
    for mode, (_, measures) in MODES.items():
        modes.add_parser(mode, help=measures, description=measures)
    probe, _ = MODES[parser.parse_args(argv).mode]
    probe()


if __name__ == "__main__":
    main()
