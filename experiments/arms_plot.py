"""The plot of experiments.arms' report: reward, entropy and the share of completions truncated at the cap per step
(mean over seeds, min-max band); greedy test accuracy per seed with each arm's mean and 95% interval; the fixed
comparisons' differences with their Welch intervals against the equivalence margin; the LoRA adapters on both bases;
an arm's seeds by the way they ran.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from experiments.arms_results import OTHER_BASE, curve_rows, first_nonfinite_step, logged
from experiments.arms_runs import ARM_NAMES, ARMS, LORA_ARMS
from experiments.arms_stats import mean_interval
from qerl import plotting

CURVES = (
    ("reward", "training reward"),
    ("entropy", "token entropy (nats)"),
    ("completions/clipped_ratio", "share of completions at the length cap"),
)


def plot(runs: list[dict], result: dict, png: Path) -> None:
    """Top: reward, entropy and the share of completions truncated at the cap per step (mean over seeds, min-max
    band, a moving average; an x marks a run's first non-finite gradient). Bottom: greedy test accuracy per seed with
    each arm's mean and 95% interval; the comparisons' differences with their Welch intervals against the +-2-point
    margin; where adapters were also evaluated on the other base, each seed on both bases; and, where an arm ran in
    several ways (card, packing), its seeds per way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    rows = {r["name"]: curve_rows(r) for r in runs}
    window = max(1, max(len(v) for v in rows.values()) // 15)
    bottom = [_accuracy_panel, _comparison_panel]
    bottom += [_base_split_panel] if result.get("base_split") else []
    bottom += [_settings_panel] if result["settings"] else []
    columns = max(3, len(bottom))
    fig, axes = plt.subplots(2, columns, figsize=(6 * columns, 9))
    for ax in axes[0][len(CURVES) :]:
        ax.axis("off")
    colors = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    for ax, (key, label) in zip(axes[0], CURVES, strict=False):
        for arm in arms:
            seeds = [rows[r["name"]] for r in runs if r["arm"] == arm]
            steps = min(len(s) for s in seeds)
            curves = [plotting.smooth([logged(r, key) for r in s[:steps]], window) for s in seeds]
            columns = [[c[i] for c in curves] for i in range(steps)]
            x = [r["step"] for r in seeds[0][:steps]]
            ax.plot(
                x, [statistics.fmean(c) for c in columns], color=colors[arm], label=f"{ARM_NAMES[arm]} ({len(seeds)})"
            )
            low, high = [min(c) for c in columns], [max(c) for c in columns]
            ax.fill_between(x, low, high, color=colors[arm], alpha=0.12, lw=0)
            for s in seeds:
                bad = first_nonfinite_step(s)
                if bad is not None and key == "reward":
                    ax.plot([bad], [0], marker="x", color=colors[arm], markersize=9, linestyle="none")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    for ax, panel in zip(axes[1], bottom, strict=False):
        panel(ax, arms, runs, result, colors)
    for ax in axes[1][len(bottom) :]:
        ax.axis("off")
    fig.suptitle(
        f"{runs[0]['model']}, GSM8K ({runs[0]['format']}), DAPO, {result['steps']} steps; curves: mean over seeds "
        f"(line), min-max (band), moving average of {window} steps",
        fontsize=10,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def _strip(ax, x: float, values: list[float], color: str) -> None:
    """Values as dots spread a little around x, and their mean with its 95% t interval beside them."""
    ax.plot([x + 0.05 * ((k % 5) - 2) for k in range(len(values))], values, "o", color=color, alpha=0.55)
    if values:
        mean, half = mean_interval(values)
        ax.errorbar([x + 0.25], [mean], yerr=[half], color=color, capsize=5, marker="s")


def _accuracy_panel(ax, arms, runs, result, colors) -> None:
    for i, arm in enumerate(arms):
        values = [result["runs"][r["name"]]["greedy"] for r in runs if r["arm"] == arm]
        _strip(ax, i, [v * 100 for v in values if v is not None], colors[arm])
    for precision, evals in result["bases"].items():
        if "greedy" in evals:
            style = ":" if precision == "nvfp4" else "--"
            ax.axhline(evals["greedy"]["accuracy"] * 100, color="gray", lw=0.8, ls=style)
    ax.set_xticks(range(len(arms)), [ARM_NAMES[a].replace(" + ", "\n+ ") for a in arms], fontsize=8)
    ax.set_ylabel("GSM8K test accuracy %, greedy (strict)")
    ax.set_title("per seed; mean ± 95% t interval; bases: BF16 dashed, NVFP4 dotted", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def _comparison_panel(ax, arms, runs, result, colors) -> None:
    """The fixed comparisons (filled), and the second look without the stuck runs (hollow, just below)."""
    questions = list(dict.fromkeys(c["question"] for c in result["comparisons"]))  # their fixed order
    looks = (
        (result["comparisons"], 0.0, "k", "all runs (fixed before)"),
        (result["without_stuck"]["comparisons"], 0.25, "none", "without runs stuck at the cap (chosen after)"),
    )
    for rows, shift, face, label in looks:
        greedy = [c for c in rows if c["measure"] == "greedy" and "difference" in c]
        for i, c in enumerate(greedy):
            below, above = (c["difference"] - c["low"]) * 100, (c["high"] - c["difference"]) * 100
            y = questions.index(c["question"]) + shift
            ax.errorbar([c["difference"] * 100], [y], xerr=[[below], [above]], fmt="o", color="k", mfc=face,
                        capsize=4, label=label if i == 0 else None)  # fmt: skip
    ax.axvspan(
        -result["margin"] * 100,
        result["margin"] * 100,
        color="green",
        alpha=0.12,
        label=f"±{result['margin'] * 100:g} points",
    )
    ax.axvline(0, color="gray", lw=0.8)
    ax.set_yticks(range(len(questions)), [re.sub(r" \([^()]*\)$", "", q) for q in questions], fontsize=8)
    ax.set_ylim(len(questions) - 0.25, -0.5)  # the comparisons top to bottom in their fixed order
    ax.set_xlabel("a - b, greedy accuracy points (Welch 95% interval)")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0))  # above the bars, never on one
    ax.grid(alpha=0.3, axis="x")


def _base_split_panel(ax, arms, runs, result, colors) -> None:
    """Each LoRA adapter greedy on the BF16 base and on a 4-bit one (its own, or the RTN base for a BF16-trained
    one), a seed's two scores joined: the slope is what sampling from the 4-bit base costs that adapter, the offset
    between colours what training on it costs."""
    for arm, trained in LORA_ARMS.items():
        label = f"trained as {ARM_NAMES[arm]}"
        for run in (r for r in runs if r["arm"] == arm):
            m = result["runs"][run["name"]]
            if m.get(OTHER_BASE) is None or m.get("greedy") is None:
                continue
            own, other = m["greedy"] * 100, m[OTHER_BASE] * 100
            on_bf16, on_4bit = (own, other) if trained == "bf16" else (other, own)
            ax.plot([0, 1], [on_bf16, on_4bit], "-o", color=colors[arm], alpha=0.6, label=label)
            label = None  # one legend entry per arm that has a line
    ax.set_xticks([0, 1], ["on the BF16 base", "on a 4-bit base"], fontsize=8)
    ax.set_xlim(-0.4, 1.4)
    ax.set_ylabel("GSM8K test accuracy %, greedy (strict)")
    ax.set_title("each adapter on both bases (a line per seed)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")


def _settings_panel(ax, arms, runs, result, colors) -> None:
    labels = []
    for effect in result["settings"]:
        for way in effect["ways"]:
            values = [result["runs"][name]["greedy"] * 100 for name in way["runs"]]
            _strip(ax, len(labels), values, colors[effect["arm"]])
            per_gpu = f" x{way['runs_per_gpu']}" if way["runs_per_gpu"] else ""
            labels.append(f"{way['card'].removeprefix('NVIDIA ')}\n{way['sharing']}{per_gpu}")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("GSM8K test accuracy %, greedy (strict)")
    ax.set_title("an arm's seeds (colour) by card and packing (x N: runs per GPU)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
