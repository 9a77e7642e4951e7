"""Moved with the other kernel-development probes to benchmarks/probes/: python -m benchmarks.probes.step_costs."""

raise SystemExit("benchmarks.step_costs moved: python -m benchmarks.probes.step_costs (same flags)")
