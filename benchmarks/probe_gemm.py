"""Moved with the other kernel-development probes to benchmarks/probes/: python -m benchmarks.probes.gemm."""

raise SystemExit("benchmarks.probe_gemm moved: python -m benchmarks.probes.gemm (same flags)")
