"""Moved to benchmarks/probes/ with the other kernel probes: python -m benchmarks.probes.decode_attention."""

raise SystemExit("benchmarks.attention moved: python -m benchmarks.probes.decode_attention (same flags)")
