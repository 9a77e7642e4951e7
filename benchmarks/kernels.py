"""Moved with the other kernel-development probes to benchmarks/probes/: python -m benchmarks.probes.nvfp4_speed."""

raise SystemExit("benchmarks.kernels moved: python -m benchmarks.probes.nvfp4_speed (same flags)")
