"""Plots of a run's metrics.jsonl (written by QeRLTrainer): reward, entropy and the AQN sigma over steps."""

from __future__ import annotations

import json
import os


def read_metrics(path: str) -> list[dict]:
    """The training log lines (those with a loss) of a metrics.jsonl, in step order."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(metrics_path: str, png_path: str, title: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path}: no training steps logged")
    steps = [r["step"] for r in rows]
    panels = [("reward", "mean reward"), ("entropy", "token entropy (nats)"), ("aqn/sigma", "AQN sigma")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 7.5), sharex=True)
    window = max(1, len(rows) // 20)
    for ax, (key, label) in zip(axes, panels, strict=True):
        values = [r.get(key) for r in rows]
        points = [(s, v) for s, v in zip(steps, values, strict=True) if v is not None]
        if not points:
            ax.text(0.5, 0.5, f"{key}: not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        xs, ys = zip(*points, strict=True)
        if key == "aqn/sigma":
            ax.step(xs, ys, where="post", color="tab:purple")
            positive = [y for y in ys if y > 0]
            if positive:  # the stages fall geometrically (1e-2 -> 1e-4): on a linear axis the last ones look like 0.
                # Logarithmic above the smallest stage, linear below it, where the noise-free first stage sits at 0.
                ax.set_yscale("symlog", linthresh=min(positive))
        else:
            ax.plot(xs, ys, alpha=0.3, color="tab:blue" if key == "reward" else "tab:green")
            ax.plot(
                xs,
                smooth(list(ys), window),
                color="tab:blue" if key == "reward" else "tab:green",
                label=f"moving mean ({window} steps)",
            )
            ax.legend(loc="best", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
