"""The speed suite's summary (experiments.speed_suite summarize): OUT/summary.md from the jobs' results, each step
benchmark's median, longest completions and phase split, each rollout row's throughput, GPTQ's time a layer, the
GEMM probe's table; --bundle adds the results and the logs' tails."""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.multi_gpu_summary import bundle, load_results


def step_lines(name: str, result: dict) -> list[str]:
    profile = result.get("profile", result)
    seconds = profile.get("step_seconds") or result.get("step_seconds") or []
    lengths = profile.get("completion_lengths") or result.get("completion_lengths") or []
    if not seconds:
        return [f"- {name}: no steps"]
    device = profile.get("device", result.get("device"))
    if "median_step_seconds" in result:  # the benchmark's own, over its timed steps (trl_baseline: steps 2-N)
        line = f"- {name}: median {result['median_step_seconds']:.2f} s of {len(seconds)} steps run, {device}"
    else:  # benchmarks.step --profile: step_seconds holds its timed steps only
        line = f"- {name}: median {statistics.median(seconds):.2f} s over {len(seconds)} steps, {device}"
    longest = [int(length[0]) for length in lengths]
    if longest:
        line += f"; longest completions {min(longest)}-{max(longest)} (median {statistics.median(longest):.0f})"
    if "dense_weight_rounds" in profile:
        line += f"; dense-weight rounds {profile['dense_weight_rounds']}"
    lines = [line]
    phases = profile.get("phases")
    if phases:
        split = ", ".join(f"{k} {v:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
        lines.append(f"  phases (s/step): {split}")
    return lines


def summarize(args) -> str:
    out = Path(args.out)
    results = load_results(out)
    text = ["# Speed suite (issue 41)", ""]
    for name, result in results.items():
        if "error" in result:
            text.append(f"- {name}: FAILED: {result['error']}")
            continue
        text += [f"- {name}: FAILED: {line}" for line in result.get("failed", [])]
        for key, value in result.items():
            if not isinstance(value, dict):
                continue
            if "rows" in value:  # benchmarks.rollout
                for row in value["rows"]:
                    if "error" in row:
                        text.append(f"- {key} {row['precision']} batch {row['batch']}: {row['error']}")
                    else:
                        text.append(
                            f"- {key} {row['precision']} batch {row['batch']}: {row['tokens_per_s']:.0f} tok/s, "
                            f"{row['ms_per_step']:.2f} ms/step"
                            + (f" (floor {row['floor_ms']:.2f})" if "floor_ms" in row else "")
                            + f", {value['device']}"
                        )
            elif "step_seconds" in value or "profile" in value:
                text += step_lines(key, value)
            elif "layer_seconds" in next(iter(value.get("sizes", {}).values()), {}):  # benchmarks.gptq_speed
                text += [
                    f"- {key} {size}{label}: {s['layer_seconds']:.2f} s a layer, ~{s['model_seconds'] / 60:.1f} min "
                    f"a model, {value['card']}"
                    for size, eager in value["sizes"].items()
                    for label, s in ((" eager", eager), (" graph", eager.get("graph")))
                    if s is not None
                ]
    kernels_log = out / "logs" / "kernels-1.log"
    if kernels_log.is_file():
        text += ["", "## probe_gemm small", ""]
        text += [line for line in kernels_log.read_text().splitlines() if line.startswith("|")]
    summary = "\n".join(text) + "\n"
    (out / "summary.md").write_text(summary)
    print(summary)
    if args.bundle:
        bundle(out, Path(args.bundle), results, summary)
    return summary
