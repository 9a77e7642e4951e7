"""The report of experiments.arms: per arm the training reward (first and last tenth of the steps), early entropy,
steps to a reward level, non-finite gradient steps and GSM8K test accuracy per protocol (per seed with its Wilson
interval, mean over seeds with its t interval); report.json, the printed table and the plot (reward and entropy per
step, accuracy along the first seed's run).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from experiments.arms_runs import ARMS, PROTOCOLS, eval_summary, metrics
from qerl import plotting

ACCURACIES = ("accuracy", "accuracy_flexible")  # eval.gsm8k: strict (the training format's answer), and lenient
# Two-sided 95% quantiles of Student's t by degrees of freedom: the interval of a mean over a few seeds.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t interval over seeds (0 for one seed)."""
    if len(values) < 2:
        return statistics.fmean(values), 0.0
    return statistics.fmean(values), T_975[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))


def _value(row: dict, key: str) -> float:
    """A logged number; NaN where the step logged none (TRL logs no entropy when every token is masked)."""
    value = row.get(key)
    return float("nan") if value is None else float(value)


def first_nonfinite_step(rows: list[dict]) -> int | None:
    """The first step whose gradient norm was not finite: the adapter is NaN from there on."""
    return next((r["step"] for r in rows if not math.isfinite(_value(r, "grad_norm"))), None)


def steps_to_reach(rows: list[dict], level: float, window: int) -> int | None:
    """The first step whose moving-average training reward reaches `level`."""
    curve = plotting.smooth([_value(r, "reward") for r in rows], window)
    return next((r["step"] for r, v in zip(rows, curve, strict=True) if v >= level), None)


def _tenth(rows: list[dict], key: str, last: bool = False) -> float:
    k = max(1, len(rows) // 10)
    return statistics.fmean(_value(r, key) for r in (rows[-k:] if last else rows[:k]))


def accuracy_curve(args, arm: str, table: dict) -> list[tuple[int, float]]:
    """(step, greedy accuracy) of the first seed's run: its base at step 0, its checkpoints, its final adapter."""
    folder = args.out / f"{arm}-seed{args.seeds[0]}"
    base = table[f"base-{ARMS[arm][0]}"].get("greedy")
    points = [(0, base["accuracy"])] if base else []
    for path in folder.glob("eval-greedy-step*.jsonl"):
        points.append((int(path.stem.removeprefix("eval-greedy-step")), eval_summary(path)["accuracy"]))
    final = eval_summary(folder / "eval-greedy.jsonl")
    rows = metrics(folder)
    if final and rows:
        points.append((rows[-1]["step"], final["accuracy"]))
    return sorted(points)


def plot(args, runs: dict[str, list[list[dict]]], table: dict, png: Path) -> None:
    """Reward and entropy per step, per arm: mean over seeds (line), min-max (band), a moving average (an x marks
    a run's first non-finite gradient); and greedy test accuracy along the first seed's run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "training reward"), ("entropy", "token entropy (nats)")]
    window = max(1, max(len(rows) for seeds in runs.values() for rows in seeds) // 15)
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(15, 4.2))
    colors = {}
    for ax, (key, label) in zip(axes, panels, strict=False):
        for arm, seeds in runs.items():
            steps = min(len(rows) for rows in seeds)
            curves = [plotting.smooth([_value(r, key) for r in rows[:steps]], window) for rows in seeds]
            columns = [[c[i] for c in curves] for i in range(steps)]
            x = [r["step"] for r in seeds[0][:steps]]
            (line,) = ax.plot(x, [statistics.fmean(c) for c in columns], label=f"{arm} ({len(seeds)} seeds)")
            colors[arm] = line.get_color()
            ax.fill_between(
                x, [min(c) for c in columns], [max(c) for c in columns], color=line.get_color(), alpha=0.2, linewidth=0
            )
            for rows in seeds:
                bad = first_nonfinite_step(rows)
                if bad is not None and key == "reward":
                    ax.plot([bad], [0], marker="x", color=line.get_color(), markersize=9, linestyle="none")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for arm in runs:
        points = accuracy_curve(args, arm, table)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", color=colors[arm], label=f"{arm} seed {args.seeds[0]}")
        final = table[arm].get("greedy")
        if final and points:
            mean, half = final["accuracy"]
            ax.errorbar([points[-1][0]], [mean], yerr=[half], color=colors[arm], capsize=4, marker="_", markersize=12)
    ax.set_xlabel("step")
    ax.set_ylabel("GSM8K test accuracy, greedy (strict)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{Path(args.model).name}, GSM8K ({args.format}), DAPO: mean over seeds (line), min-max (band), "
        f"moving average of {window} steps; accuracy: first seed's checkpoints, bar = mean over seeds "
        "with 95% t interval",
        fontsize=9,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def report(args) -> dict:
    """report.json, the PNG and a table: per arm the training reward (first and last tenth of steps, mean and sd
    over seeds), early entropy, steps to a reward level, non-finite gradient steps, and GSM8K test accuracy per
    protocol (per seed with its Wilson interval; mean over seeds with its t interval); the bases for reference."""
    names = sorted(p.name for p in args.out.iterdir() if p.is_dir()) if args.out.is_dir() else []
    curves: dict[str, list[list[dict]]] = {}
    table: dict[str, dict] = {}
    for precision in ("bf16", "nvfp4"):
        folder = args.out / f"base-{precision}"
        table[f"base-{precision}"] = {p: eval_summary(folder / f"eval-{p}.jsonl") for p in PROTOCOLS}
    for arm in ARMS:
        folders = [args.out / n for n in names if n.startswith(f"{arm}-seed")]
        curves[arm] = [rows for rows in (metrics(f) for f in folders) if rows]
        row = table[arm] = {"runs": [f.name for f in folders]}
        if curves[arm]:
            row["steps"] = [rows[-1]["step"] for rows in curves[arm]]
            row["reward_first_tenth"] = _mean_sd([_tenth(rows, "reward") for rows in curves[arm]])
            row["reward_last_tenth"] = _mean_sd([_tenth(rows, "reward", last=True) for rows in curves[arm]])
            row["entropy_first_tenth"] = _mean_sd([_tenth(rows, "entropy") for rows in curves[arm]])
            row["first_nonfinite_grad_step"] = [first_nonfinite_step(rows) for rows in curves[arm]]
        for protocol in PROTOCOLS:
            summaries = [s for s in (eval_summary(f / f"eval-{protocol}.jsonl") for f in folders) if s]
            if summaries:
                row[protocol] = {key: mean_interval([s[key] for s in summaries]) for key in ACCURACIES}
                row[protocol]["per_seed"] = [
                    {key: (s[key], *s[f"{key}_ci95"]) for key in ACCURACIES} for s in summaries
                ]
    trained = {arm: seeds for arm, seeds in curves.items() if seeds}
    if trained:
        # The reward level every arm's seeds end above on average (90% of the lowest arm's last tenth).
        level = 0.9 * min(table[arm]["reward_last_tenth"][0] for arm in trained)
        window = max(1, min(len(rows) for seeds in trained.values() for rows in seeds) // 15)
        for arm, seeds in trained.items():
            reached = [steps_to_reach(rows, level, window) for rows in seeds]
            table[arm]["steps_to_reward"] = {"level": level, "window": window, "per_seed": reached}
        for arm in trained:
            table[arm]["accuracy_curve"] = accuracy_curve(args, arm, table)
    with open(args.out / "report.json", "w") as f:
        json.dump(table, f, indent=2)
    if trained:
        plot(args, trained, table, args.png)
    _print_report(args, table, trained)
    return table


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _print_report(args, table: dict, trained: dict) -> None:
    print(
        f"\n{'arm':<16} {'reward first -> last tenth':<28} {'entropy 1st':<12} {'steps to level':<16} "
        + " ".join(f"{p + ' strict (mean ± t95)':<26}" for p in PROTOCOLS)
    )
    for arm in trained:
        row = table[arm]
        (f_mean, f_sd), (l_mean, l_sd) = row["reward_first_tenth"], row["reward_last_tenth"]
        reach = ",".join("-" if s is None else str(s) for s in row["steps_to_reward"]["per_seed"])
        cells = [f"{row[p]['accuracy'][0]:.2%} ± {row[p]['accuracy'][1]:.2%}" if p in row else "-" for p in PROTOCOLS]
        print(
            f"{arm:<16} {f'{f_mean:.3f}±{f_sd:.3f} -> {l_mean:.3f}±{l_sd:.3f}':<28} "
            f"{row['entropy_first_tenth'][0]:<12.3f} {reach:<16} " + " ".join(f"{c:<26}" for c in cells)
        )
    for precision in ("bf16", "nvfp4"):
        summaries = table[f"base-{precision}"]
        cells = [
            f"{s['accuracy']:.2%} [{s['accuracy_ci95'][0]:.1%}, {s['accuracy_ci95'][1]:.1%}]" if s else "-"
            for s in summaries.values()
        ]
        print(f"{'base ' + precision:<16} {'(no training)':<58} " + " ".join(f"{c:<26}" for c in cells))
    print(f"report: {args.out / 'report.json'}; plot: {args.png}")
