"""The length-cap sweep (issue 49): which change to the recipe keeps NVFP4 + LoRA runs of the real 1.5B from locking
themselves at the completion cap, chosen on training data only (no test set is read).

    python -m experiments.cap_sweep train --model qwen2.5-coder-1.5b-instruct --cells fail,soft128,cap1024,lr1e-4 \\
        --seeds 100,101,102,103 --mps --per-gpu 8
    python -m experiments.cap_sweep report --model qwen2.5-coder-1.5b-instruct

On a lent machine: experiments/lease.sh starts it in a session of its own and packs the records after every call
(docs/benchmarks.md gives the lease's commands; --gguf takes the model's GGUF carried there).

A cell is the model's recipe plus a few `qerl.train` flags (CELLS), run on the NVFP4 base without AQN for the recipe's
51 steps. The control cell `recipe` is the recipe the sweep ran on: experiments.arms' NVFP4 + LoRA records of the
same experiment and recipe file (SHA-256; results/arms/MODEL) count toward it. Once the recipe takes the winner, the
sweep's records stay a sweep of the recipe as it was: `train` refuses to add runs of the changed file to them. Each
finished run is a record under results/cap_sweep/MODEL (the arms' format, experiments/arms_results.py, with its cell
and the cell's flags), written as soon as it ends and never run again, so that seeds from several leases add up.

Endpoints, per run, fixed before the runs (docs/benchmarks.md, "The length-cap sweep"):
  any_half         a step with >= 50% of its completions truncated
  stuck            the arms report's rule: >= 90% of the last tenth's completions truncated
  truncated_10_30  mean share of completions truncated over steps 10-30
  reward_last_10   mean earned training reward over the last ten steps (what the task's rewards paid, before a
                   truncated completion is failed or a length punishment added: the same measure in every cell)
The winner (WINNER_RULE): among cells with >= 8 runs, none stuck and at most one with any_half, the highest mean
reward_last_10; none qualifying, no winner.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.launch import REPO, SHARED_GSM8K
from experiments.arms import checkpoints
from experiments.arms_results import (
    RESULTS,
    curve_rows,
    gpu_name,
    load_records,
    logged,
    record_path,
    run_record,
    write_record,
    write_report,
)
from experiments.arms_runs import RunPace, Task, experiment_setting, mps_daemon, run_tasks, say, train_task
from experiments.arms_stats import fisher_exact, mean_interval, welch
from qerl import cli


@dataclass(frozen=True)
class Cell:
    what: str
    flags: tuple[str, ...] = ()
    lr: float | None = None  # None: the sweep's --lr (the recipe's)


CELLS = {
    "recipe": Cell("the recipe as swept: truncated completions masked out of the loss (DAPO)"),
    "fail": Cell(
        "(a) truncated completions kept in the loss, their reward cut to a failure (0)",
        ("--mask-truncated-completions", "false", "--fail-truncated-completions", "true"),
    ),
    "soft128": Cell(
        "(b) DAPO's soft overlong punishment over the last 128 tokens, truncated completions unmasked",
        ("--mask-truncated-completions", "false", "--soft-overlong-cache", "128"),
    ),
    "cap1024": Cell("(c) a 1,024-token cap", ("--max-completion-length", "1024")),
    "lr1e-4": Cell("(d) peak learning rate 1e-4", lr=1e-4),
}
SWEEP_RESULTS = REPO / "results" / "cap_sweep"
CONTROL_ARM = "nvfp4_lora"  # experiments.arms' arm that is the control cell
MOSTLY, STUCK = 0.5, 0.9  # shares of completions truncated: a step's, the last tenth's
WINDOW = (10, 30)  # steps of truncated_10_30, both included
LAST = 10  # steps of reward_last_10
MIN_RUNS, MAX_ANY_HALF = 8, 1
WINNER_RULE = (
    f"among cells with >= {MIN_RUNS} runs, none stuck and at most {MAX_ANY_HALF} with a step >= 50% truncated, the "
    "highest mean reward_last_10"
)
ENDPOINTS = ("any_half", "stuck", "truncated_10_30", "reward_last_10")


def earned_reward(row: dict) -> float:
    """What the task's rewards paid a step's completions on average. Steps logged with the truncation metrics rebuild
    it from the truncated and finished means; older steps (the recipe's masked runs) logged exactly that as reward."""
    from qerl.truncation import FINISHED_REWARD, TRUNCATED_REWARD  # transformers: not for --help

    cut, done = row.get(TRUNCATED_REWARD), row.get(FINISHED_REWARD)
    if cut is None and done is None:
        return logged(row, "reward")
    share = logged(row, "completions/clipped_ratio")
    return (cut if cut is not None else 0.0) * share + (done if done is not None else 0.0) * (1 - share)


def endpoints(record: dict) -> dict[str, float | bool]:
    rows = curve_rows(record)
    shares = [logged(r, "completions/clipped_ratio") for r in rows]
    tenth = shares[-max(1, len(rows) // 10) :]
    window = [s for r, s in zip(rows, shares, strict=True) if WINDOW[0] <= r["step"] <= WINDOW[1]]
    return {
        "any_half": any(s >= MOSTLY for s in shares),
        "stuck": statistics.fmean(tenth) >= STUCK,
        "truncated_10_30": statistics.fmean(window) if window else float("nan"),
        "reward_last_10": statistics.fmean(earned_reward(r) for r in rows[-LAST:]),
    }


def cell_of(record: dict) -> str | None:
    """A sweep record's cell; an arms record of the control arm with the sweep's settings is the control."""
    if "cell" in record:
        return record["cell"]
    return "recipe" if record["arm"] == CONTROL_ARM else None


# ----------------------------------------------------------------------------------------------------------
# Running


def prepare(args) -> dict[str, str]:
    """The BF16 and NVFP4 folders of --model: fetched (from --gguf where given) and quantized once."""
    if args.gguf is not None:
        from qerl.models.fetch import fetch

        fetch(args.model, args.checkpoint_dir / args.model, gguf=args.gguf)
    folders = checkpoints(args)
    for precision, folder in folders.items():
        say(f"{precision}: {folder}")
    return folders


def train(args) -> None:
    """Each cell x seed not yet recorded, as `python -m qerl.train` on the NVFP4 base without AQN; a run's record is
    written as soon as it ends."""
    setting = experiment_setting(args, args.steps)
    swept = swept_recipe(args)
    if swept not in (None, setting["recipe_sha256"]):
        raise SystemExit(
            f"{args.results} holds a sweep of {setting['recipe']} as it was (SHA-256 {swept[:8]}); the file is now "
            f"{setting['recipe_sha256'][:8]}: pass --results DIR for a sweep of the recipe as it is"
        )
    nvfp4 = prepare(args)["nvfp4"]
    pace = RunPace(60 * args.run_minutes) if args.run_minutes else None
    tasks, kept = [], []
    for seed in args.seeds:
        for name in args.cells:
            cell, run = CELLS[name], f"{name}-seed{seed}"
            if record_path(args.results, run).exists():
                kept.append(run)
                continue
            lr = cell.lr or args.lr
            task = train_task(args, run, nvfp4, False, lr, seed, args.steps)
            task.command = task.command and task.command + list(cell.flags)
            task.expected_seconds = pace.estimate if pace else None
            record = {**setting, "arm": CONTROL_ARM, "precision": "nvfp4", "aqn": False, "seed": seed, "lr": lr}
            task.on_done = _recorder(args, run, {**record, "cell": name, "cell_flags": list(cell.flags)}, pace)
            tasks.append(task)
    if kept:
        say(f"train: {len(kept)} run(s) already recorded in {args.results}, not run again: {', '.join(kept)}")
    with mps_daemon(args.out) if args.mps else contextlib.nullcontext({}) as env:
        run_tasks(tasks, args.gpu_ids, args.per_gpu, args.finish_by, env)
    report(args)


def _recorder(args, run: str, setting: dict, pace: RunPace | None):
    def write(task: Task) -> None:
        extra = {"card": gpu_name(task.gpu) if args.gpu_ids else "cpu", "gpu": task.gpu}
        if task.seconds is not None:
            extra["train_seconds"] = round(task.seconds, 1)
            if pace is not None:
                pace.observe(task.seconds)
        write_record(record_path(args.results, run), run_record(args.out / run, {**setting, **extra}, ()))

    return write


# ----------------------------------------------------------------------------------------------------------
# Report


def swept_recipe(args, swept: list[dict] | None = None) -> str | None:
    """The recipe (SHA-256) the sweep's records (`swept`, else those in --results) ran on: one, since a cell is that
    recipe plus its flags."""
    digests = {r.get("recipe_sha256") for r in (load_records(args.results) if swept is None else swept)}
    if len(digests) > 1:
        raise SystemExit(f"{args.results}: runs of {len(digests)} recipes ({', '.join(sorted(map(str, digests)))}); "
                         "a sweep's cells are one recipe plus their flags")  # fmt: skip
    return next(iter(digests), None)


def collect(args) -> dict[str, list[dict]]:
    """The records of each cell, the control's arms records included (same step count, format and recipe only)."""
    swept = load_records(args.results)
    recipe = swept_recipe(args, swept)
    records = swept + [r for r in load_records(args.arms_results) if recipe is None or r.get("recipe_sha256") == recipe]
    cells: dict[str, list[dict]] = {}
    for record in records:
        name = cell_of(record)
        same = (record["steps"], record.get("format"), record.get("train_flags") or [])
        if name is not None and same == (args.steps, args.format, args.train_flags):
            cells.setdefault(name, []).append(record)
    return {name: sorted(cells[name], key=lambda r: r["seed"]) for name in CELLS if name in cells}


def summarise(cells: dict[str, list[dict]]) -> dict:
    per_run = {name: [endpoints(r) for r in runs] for name, runs in cells.items()}
    table, comparisons = {}, []
    control = per_run.get("recipe", [])
    for name, runs in per_run.items():
        row = {"what": CELLS[name].what, "seeds": [r["seed"] for r in cells[name]], "n": len(runs)}
        row["cards"] = sorted({r.get("card", "?") for r in cells[name]})
        row["any_half"] = sum(r["any_half"] for r in runs)
        row["stuck"] = sum(r["stuck"] for r in runs)
        for key in ("truncated_10_30", "reward_last_10"):
            mean, half = mean_interval([r[key] for r in runs])
            row[key] = {"mean": mean, "ci95": half}
        table[name] = row
        if name != "recipe" and control:
            comparison = {"cell": name}
            for key in ("any_half", "stuck"):
                comparison[f"{key}_fisher_p"] = fisher_exact(row[key], len(runs), table["recipe"][key], len(control))
            for key in ("truncated_10_30", "reward_last_10"):
                diff = welch([r[key] for r in runs], [r[key] for r in control])
                comparison[key] = diff.as_dict() if diff else None
            comparisons.append(comparison)
    qualifying = [
        name
        for name, row in table.items()
        if row["n"] >= MIN_RUNS and row["stuck"] == 0 and row["any_half"] <= MAX_ANY_HALF
    ]
    winner = max(qualifying, key=lambda n: table[n]["reward_last_10"]["mean"]) if qualifying else None
    return {"rule": WINNER_RULE, "winner": winner, "cells": table, "against_recipe": comparisons}


def markdown(result: dict) -> str:
    lines = [
        "| cell | runs (seeds) | a step >= 50% truncated | stuck | truncated share, steps 10-30 | earned reward, last "
        "10 steps |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in result["cells"].items():
        seeds = ",".join(map(str, row["seeds"]))
        t, r = row["truncated_10_30"], row["reward_last_10"]
        lines.append(
            f"| {name}: {row['what']} | {row['n']} ({seeds}) | {row['any_half']} | {row['stuck']} | "
            f"{t['mean']:.3f} ± {t['ci95']:.3f} | {r['mean']:.3f} ± {r['ci95']:.3f} |"
        )
    if result["against_recipe"]:
        lines += ["", "| cell - recipe | truncated 10-30 (95% CI) | reward last 10 (95% CI) | Fisher p: any >= 50%, "
                  "stuck |", "|---|---|---|---|"]  # fmt: skip
        for c in result["against_recipe"]:
            cells = [
                f"{d['difference']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" if d else "-"
                for d in (c["truncated_10_30"], c["reward_last_10"])
            ]
            lines.append(
                f"| {c['cell']} | {cells[0]} | {cells[1]} | {c['any_half_fisher_p']:.2f}, {c['stuck_fisher_p']:.2f} |"
            )
    lines += ["", f"Winner ({result['rule']}): {result['winner'] or 'none yet'}."]
    return "\n".join(lines) + "\n"


def plot(cells: dict[str, list[dict]], png: Path) -> None:
    """The truncated share and the earned reward per step, every run a thin line and each cell's mean a thick one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    curves = (("completions/clipped_ratio", "share of completions at the cap"), (None, "earned training reward"))
    for ax, (key, label) in zip(axes, curves, strict=True):
        for i, (name, runs) in enumerate(cells.items()):
            lines = [[earned_reward(r) if key is None else logged(r, key) for r in curve_rows(run)] for run in runs]
            steps = min(len(line) for line in lines)
            for line in lines:
                ax.plot(range(1, steps + 1), line[:steps], color=f"C{i}", alpha=0.25, lw=0.8)
            mean = [statistics.fmean(line[s] for line in lines) for s in range(steps)]
            ax.plot(range(1, steps + 1), mean, color=f"C{i}", lw=2.2, label=f"{name} ({len(runs)} runs)")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].axhline(MOSTLY, color="grey", ls=":", lw=1)
    axes[0].legend(fontsize=8)
    fig.suptitle("Length-cap sweep: NVFP4 + LoRA on the real 1.5B, each run a thin line, each cell's mean thick")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def report(args) -> dict:
    cells = collect(args)
    result = {**summarise(cells), "steps": args.steps, "format": args.format}
    written = write_report(args.out, "cap_sweep", result, markdown(result))
    if cells:
        plot(cells, args.png)
        print(f"report: {written}; plot: {args.png}")
    return result


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "train", "report"))
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a fetchable model or a BF16 folder")
    parser.add_argument("--recipe", type=Path, help="training recipe (default: the model's)")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("ckpt"), help="where its BF16 and NVFP4 folders go")
    parser.add_argument("--out", type=Path, default=Path("runs/cap_sweep"), help="the runs' folders and the report")
    parser.add_argument("--png", type=Path, help="the report's plot (default: OUT/cap_sweep.png)")
    parser.add_argument("--train-data", type=Path, default=SHARED_GSM8K / "train.jsonl")
    parser.add_argument("--cells", type=cli.comma_list(CELLS), default=[c for c in CELLS if c != "recipe"])
    parser.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",") if x], default=[100, 101, 102, 103])
    parser.add_argument("--steps", type=int, default=51, help="steps per run (the arms' count)")
    parser.add_argument("--lr", type=float, default=3e-4, help="the peak learning rate of cells that keep the recipe's")
    parser.add_argument("--gpu-ids", type=lambda t: [int(x) for x in t.split(",") if x], help="default: all visible")
    parser.add_argument("--per-gpu", type=int, default=8, help="runs at a time on each GPU")
    parser.add_argument("--mps", action="store_true", help="share each GPU's SMs between its runs (CUDA MPS)")
    parser.add_argument("--finish-by", type=float, help="unix time: a run that would end later is not started")
    parser.add_argument("--run-minutes", type=float, help="a run's expected minutes until one has finished")
    parser.add_argument("--results", type=Path, help="the sweep's records (default: results/cap_sweep/MODEL)")
    parser.add_argument("--arms-results", type=Path, help="the control's records (default: results/arms/MODEL)")
    parser.add_argument("--gguf", type=Path, help="the model's GGUF on disk (a machine without the package index)")
    parser.add_argument(
        "--train-flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="the rest of the command line goes to every qerl.train run (recorded; the report pools equal ones)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--train-flags") if "--train-flags" in argv else len(argv)
    args = parser.parse_args(argv[:cut])  # qerl.train checks the rest itself
    args.train_flags = argv[cut + 1 :]
    name = Path(args.model).name.removesuffix("-nvfp4")
    args.results = args.results or SWEEP_RESULTS / name
    args.arms_results = args.arms_results or RESULTS / name
    args.png = args.png or args.out / "cap_sweep.png"
    # What train_task and experiment_setting read of an experiments.arms invocation.
    args.format, args.temperature = "gsm8k_hash", 1.0
    if args.command != "report" and args.gpu_ids is None:
        import torch

        args.gpu_ids = list(range(torch.cuda.device_count()))
    if args.mps and not args.gpu_ids:
        parser.error("--mps needs GPUs")
    args.out.mkdir(parents=True, exist_ok=True)
    {"prepare": prepare, "train": train, "report": report}[args.command](args)


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "experiments.cap_sweep"))
