"""Moved with the other kernel-development probes to benchmarks/probes/: python -m benchmarks.probes.plot_decode."""

raise SystemExit("benchmarks.plot_decode moved: python -m benchmarks.probes.plot_decode (same flags)")
