r"""Where a native decode step's time goes, as a picture: one stacked bar per (model, weights, batch) from the JSON
files of `python -m benchmarks.rollout --rollout-backend native --profile`, with the timed run's graph step and
the bytes floor marked beside each bar.

    python -m benchmarks.probes.plot_decode runs/native7.json runs/native32_nvfp4.json runs/native32_bf16.json \
        --out docs/decode_step.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.rollout import KERNEL_FAMILIES

# Stacking order (bottom up) and colours: the GEMMs first, the rest after; a family not listed goes on top.
FAMILIES = list(dict.fromkeys(family for _, family in KERNEL_FAMILIES)) + ["other"]
FAMILIES.insert(0, FAMILIES.pop(FAMILIES.index("NVFP4 GEMM")))


def load_rows(paths: list[str]) -> tuple[dict[str, list[dict]], str]:
    """Profiled rows by model size (each file's rows in its order) and the GPUs they ran on."""
    by_size: dict[str, list[dict]] = {}
    devices = set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        devices.add(data.get("device", ""))
        rows = [r for r in data["rows"] if "kernels_us_per_step" in r]
        if not rows:
            raise SystemExit(
                f"{path}: no profiled rows (run benchmarks.rollout with --rollout-backend native --profile)"
            )
        by_size.setdefault(data["args"]["size"], []).extend(rows)
    return by_size, " / ".join(sorted(d for d in devices if d))


def plot(by_size: dict[str, list[dict]], png: str, device: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    colours = dict(zip(FAMILIES, plt.get_cmap("tab10").colors, strict=False))
    fig, axes = plt.subplots(1, len(by_size), figsize=(5.2 * len(by_size), 4.8), squeeze=False)
    for ax, (size, rows) in zip(axes[0], by_size.items(), strict=True):
        labels, seen = [], set()
        for x, row in enumerate(rows):
            kernels = row["kernels_us_per_step"]
            bottom = 0.0
            for family in FAMILIES + sorted(set(kernels) - set(FAMILIES)):
                ms = kernels.get(family, 0.0) / 1e3
                if ms <= 0:
                    continue
                ax.bar(
                    x,
                    ms,
                    bottom=bottom,
                    color=colours.get(family, "grey"),
                    width=0.6,
                    label=None if family in seen else family,
                )
                seen.add(family)
                bottom += ms
            ax.plot(
                [x - 0.35, x + 0.35],
                [row["ms_per_step"]] * 2,
                color="black",
                lw=2,
                label="graph step (timed run)" if x == 0 else None,
            )
            ax.plot(
                [x - 0.35, x + 0.35],
                [row["floor_ms"]] * 2,
                color="black",
                lw=1.5,
                ls="--",
                label="bytes floor" if x == 0 else None,
            )
            waves = f"\n{row['waves']} waves" if row.get("waves", 1) > 1 else ""
            labels.append(f"{row['precision'].upper()}\nbatch {row['batch']}{waves}")
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"Qwen2.5-{size.upper()} shapes" if size != "llama8b" else "Llama-3.1-8B shapes")
        ax.grid(axis="y", alpha=0.3)
    unique = {}
    for ax in axes[0]:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            unique.setdefault(name, handle)
    ncol = min(4, 2 * len(by_size))  # a one-panel figure is too narrow for 4 columns of names
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=ncol, fontsize=8)
    fig.suptitle(f"Native engine decode step by kernel family{f', {device}' if device else ''}", fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.04 * -(-len(unique) // ncol), 1, 1))
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="benchmarks.rollout --rollout-backend native --profile outputs")
    parser.add_argument("--out", default="runs/decode_step.png")
    args = parser.parse_args(argv)
    by_size, devices = load_rows(args.json)
    plot(by_size, args.out, device=devices)
    print(args.out)


if __name__ == "__main__":
    main()
