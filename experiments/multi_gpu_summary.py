"""The summary of experiments.multi_gpu_suite: its results (OUT/results/*.json) as docs/benchmarks.md rows in
OUT/summary.md (the benchmark tables per model size, the resume checks, the real model's one-GPU vs DDP steps), and
the bundle for a runner that can bring back only a few files: summary.md, results.json and the logs' last lines.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from experiments import resume_check
from experiments.arms_results import software_versions


def load_results(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "results").glob("*.json"))}


def bench_rows(results: dict[str, dict], size: str) -> list[str]:
    rows = [r for name, r in results.items() if name.startswith(f"{size}-")]
    if not rows:
        return []
    one = {r["config"]: r["samples_per_s"] for r in rows if r.get("gpus") == 1 and "samples_per_s" in r}
    first = next((r for r in rows if "device" in r), {})
    lines = [
        f"Model {first.get('model', '?')}: {first.get('batch', '?')} completions per GPU per step of <= "
        f"{first.get('new_tokens', '?')} tokens, {first.get('steps', '?')} steps (the first and the profiled last not "
        "timed); one-GPU rows ran side by side on separate GPUs, as did pairs of two-GPU rows.",
        "",
        "| config | GPUs | samples/s | x one GPU | step s | rollout (refresh) s | log-prob fwd s | backward s "
        "| other s | comm s | peak GiB per GPU (torch / driver) | adapters equal | ranks' prompts differ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"ddp": 0, "fsdp": 1, "zero2": 2, "zero3": 3}
    for r in sorted(
        rows, key=lambda r: (order.get(r.get("config", "").split("-")[0], 9), r.get("gpus", 0), r.get("config", ""))
    ):
        if "error" in r or "samples_per_s" not in r:
            lines.append(
                f"| {r.get('config', r['job'])} | {r.get('gpus', '?')} | failed: "
                f"{str(r.get('error', '?'))[:150]} |||||||||||"
            )
            continue
        # 32B: DDP's one-GPU row is every config's baseline (one process is one process, whatever the config).
        base = one.get(r["config"].split("-")[0]) or (one.get("ddp") if size == "32b" else None)
        s = r["split_s"]
        scale = f"{r['samples_per_s'] / base:.2f}x" if base else ""
        comm = "-" if r["comm_s"] is None else f"{r['comm_s']:.2f}"
        peaks = [p for p in r["peak_gib"] if p is not None]
        drivers = [p for p in r["peak_driver_gib"] if p is not None]
        peak = f"{max(peaks):.1f} / {max(drivers):.1f}" if peaks and drivers else "-"
        lines.append(
            f"| {r['config']} | {r['gpus']} | {r['samples_per_s']:.2f} | "
            f"{scale} | {r['step_s']:.2f} | "
            f"{s['rollout']:.2f} ({s['refresh']:.2f}) | {s['log-prob forwards']:.2f} | {s['backward']:.2f} | "
            f"{s['other']:.2f} | {comm} | {peak} | "
            f"{'yes' if r['adapters_equal'] else 'NO'} | "
            f"{ {None: '-', True: 'yes', False: 'NO'}[r['prompts_differ']] } |"
        )
    return lines


def resume_lines(results: dict[str, dict]) -> list[str]:
    lines = []
    for name, r in results.items():
        if not name.startswith("resume-"):
            continue
        if "error" in r:
            lines.append(f"- {name}: failed: {r['error']}")
            continue
        for line in resume_check.report(r).splitlines():
            lines.append(("- " if not line.startswith(" ") else "  ") + line.strip())
    return lines


def real_lines(results: dict[str, dict]) -> list[str]:
    runs = {n: r for n, r in results.items() if n.startswith("real-") and n != "real-prep"}
    if not runs:
        return []
    lines = ["| run | step | reward (std) | loss | step s |", "|---|---|---|---|---|"]
    for name, r in sorted(runs.items()):
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:150]} ||||")
            continue
        for row in r["steps"]:
            lines.append(
                f"| {name} | {row['step']} | {row.get('reward', float('nan')):.3f} "
                f"({row.get('reward_std', float('nan')):.3f}) | {row.get('loss', float('nan')):.4f} | "
                f"{row.get('step_time', float('nan')):.2f} |"
            )
    done = [r for r in runs.values() if "error" not in r and r["steps"]]
    if len(done) == 2:
        a, b = (r["steps"][0] for r in done)
        same = done[0]["first_step_prompts"] == done[1]["first_step_prompts"]
        # 64 samples per step: the standard error of a step's mean reward is about its std / 8.
        diff = abs(a["reward"] - b["reward"])
        se = (a.get("reward_std", 0) ** 2 / 64 + b.get("reward_std", 0) ** 2 / 64) ** 0.5
        sigmas = "0" if diff == 0 else f"{diff / se:.1f}" if se else "inf"
        lines.append(
            f"\nFirst step: {'the same' if same else 'DIFFERENT'} {len(done[0]['first_step_prompts'])} "
            f"prompts; mean rewards differ by {diff:.3f}, {sigmas} standard errors of the difference (the "
            f"samples differ: each rank draws its own); losses {a['loss']:.4f} vs {b['loss']:.4f}."
        )
    return lines


def summarize(args) -> str:
    out = Path(args.out)
    results = load_results(out)
    devices = sorted({r["device"] for r in results.values() if r.get("device")})
    v = software_versions()
    text = [
        f"Machine: {args.gpus} x {', '.join(devices) or '?'}; " + ", ".join(f"{k} {x}" for k, x in v.items()),
        f"Command: python -m experiments.multi_gpu_suite run --out {args.out}"
        + (" --gguf GGUF" if any(n.startswith("real-") for n in results) else ""),
        "",
    ]
    for size in ("7b", "32b"):
        rows = bench_rows(results, size)
        if rows:
            text += [f"### {size.upper()} NVFP4, random init (benchmarks.multi_gpu)", "", *rows, ""]
    resume = resume_lines(results)
    if resume:
        text += ["### Checkpoint save and resume (experiments.resume_check)", "", *resume, ""]
    real = real_lines(results)
    if real:
        text += ["### Qwen2.5-Coder-1.5B-Instruct NVFP4, one GPU vs DDP on 4 (same global batch)", "", *real, ""]
    walls = {n: round(r.get("job_wall_s", 0)) for n, r in results.items()}
    text += [f"Job wall seconds: {walls}"]
    summary = "\n".join(text) + "\n"
    (out / "summary.md").write_text(summary)
    print(summary)
    if getattr(args, "bundle", None):
        bundle(out, Path(args.bundle), results, summary)
    return summary


def bundle(out: Path, dest: Path, results: dict, summary: str, tail_lines: int = 300) -> None:
    """summary.md, results.json and logs.tar.gz (the last lines of every log) in `dest`: three files."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.md").write_text(summary)
    (dest / "results.json").write_text(json.dumps(results, indent=1))
    with tarfile.open(dest / "logs.tar.gz", "w:gz") as tar:
        for log in sorted(out.rglob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail_lines:]
            data = ("\n".join(lines) + "\n").encode()
            info = tarfile.TarInfo(str(log.relative_to(out)))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
