"""The paper's comparison in miniature on a real model: BF16 / NVFP4 base, LoRA, AQN on or off, seeds, intervals.

    python -m experiments.arms prepare --model M                         (fetch it, quantize it to NVFP4)
    python -m experiments.arms probe --model M --formats gsm8k,gsm8k_hash,gsm8k_lenient      (prompt and reward)
    python -m experiments.arms sweep --model M --lrs 3e-5,1e-4,3e-4 --steps 25          (each arm's learning rate)
    python -m experiments.arms train --model M --seeds 0,1,2 --steps 150                  (arms x seeds, evaluated)
    python -m experiments.arms report --model M                                          (table, JSON and PNG)

Each run is `python -m qerl.train` with the model's recipe (RECIPES, or --recipe) on the GSM8K train file, then
`python -m eval.gsm8k` of its adapter on the GSM8K test file (every problem, greedy and the reference protocol),
each in its own process, `--per-gpu` at a time on each of `--gpus` GPUs (one run leaves most of a GPU idle).
`train` evaluates the first seed's intermediate checkpoints too, and both bases without an adapter. Runs whose
outputs exist are skipped, so an interrupted experiment continues where it stopped.

The format, the temperature and the learning rates are chosen on training prompts and training reward, never on
the test set. `train --steps auto --finish-by T` sizes the runs from the sweep's seconds per step so that training
and the evaluations end by the time T (a lent machine that goes back at a fixed time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qerl import plotting

REPO = Path(__file__).resolve().parents[1]
RECIPES = {  # a fetchable model -> the recipe its arms run
    "smollm2-135m-instruct": REPO / "configs" / "smollm2_gsm8k_hash.yaml",
    "qwen2.5-coder-1.5b-instruct": REPO / "configs" / "qwen2.5_coder_1.5b_gsm8k_hash.yaml",
}
# arm -> (base checkpoint precision, AQN on). bf16_lora_aqn is the ablation the reference's users asked for
# (NVlabs/QeRL#11): AQN's noise without the quantization it is meant to extend.
ARMS = {
    "bf16_lora": ("bf16", False),
    "nvfp4_lora": ("nvfp4", False),
    "nvfp4_lora_aqn": ("nvfp4", True),
    "bf16_lora_aqn": ("bf16", True),
}
PROTOCOLS = ("greedy", "reference")
ACCURACIES = ("accuracy", "accuracy_flexible")  # eval.gsm8k: strict (the training format's answer), and lenient
EVAL_FORMATS = {"gsm8k": "think_answer", "gsm8k_hash": "gsm8k_hash", "gsm8k_lenient": "gsm8k_hash"}
# Two-sided 95% quantiles of Student's t by degrees of freedom: the interval of a mean over a few seeds.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
_print_lock = threading.Lock()


def say(message: str) -> None:
    with _print_lock:
        print(f"[arms {time.strftime('%H:%M:%S')}] {message}", flush=True)


def checkpoints(args) -> dict[str, str]:
    from qerl.models.fetch import bf16_and_nvfp4

    bf16, nvfp4 = bf16_and_nvfp4(args.model, args.checkpoint_dir, "cuda" if _cuda() else "cpu")
    return {"bf16": bf16, "nvfp4": nvfp4}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def recipe_for(model: str, override: Path | None = None) -> Path:
    """The recipe of a fetchable model (or its folder, named as fetch names it), unless one is given."""
    if override:
        return override
    name = Path(model).name.removesuffix("-nvfp4")
    if name not in RECIPES:
        raise SystemExit(f"no recipe known for {model}; pass --recipe (known: {', '.join(RECIPES)})")
    return RECIPES[name]


# ----------------------------------------------------------------------------------------------------------
# Running: tasks on GPU slots


def run_logged(command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
        if code != 0:
            f.write(f"exit code {code}\n")
    if code != 0:
        raise RuntimeError(f"exit code {code}: {' '.join(command[:4])} ... (log: {log})")


@dataclass
class Task:
    name: str
    command: list[str] | None  # None: nothing left to do (its output exists)
    log: Path
    after: Task | None = None  # runs once that task succeeded; skipped if it failed
    optional: bool = False  # an evaluation: skipped when it would start after the deadline
    state: str = "pending"  # pending | running | done | failed | skipped


def run_tasks(tasks: list[Task], gpus: int, per_gpu: int, finish_by: float | None = None) -> None:
    """Run the tasks, `per_gpu` at a time on each GPU (CUDA_VISIBLE_DEVICES), first ready first; a task waits for
    the one it comes after. Raises SystemExit naming the failed tasks once all have ended."""
    lock = threading.Condition()

    def next_ready() -> Task | None:
        with lock:
            while True:
                pending = [t for t in tasks if t.state == "pending"]
                if not pending:
                    return None
                for task in pending:
                    if task.after is not None and task.after.state in ("failed", "skipped"):
                        task.state = "skipped"
                    elif task.after is None or task.after.state == "done":
                        task.state = "running"
                        return task
                lock.wait(timeout=5)

    def worker(gpu: int) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)} if gpus > 0 else None
        while (task := next_ready()) is not None:
            state = "done"
            if task.command is None:
                pass
            elif task.optional and finish_by is not None and time.time() > finish_by:
                say(f"{task.name}: skipped, past the deadline")
                state = "skipped"
            else:
                start = time.time()
                say(f"{task.name}: started" + (f" on GPU {gpu}" if gpus else ""))
                try:
                    run_logged(task.command, task.log, env)
                    say(f"{task.name}: done in {time.time() - start:.0f} s")
                except RuntimeError as err:
                    state = "failed"
                    say(f"{task.name}: FAILED: {err}")
            with lock:
                task.state = state
                lock.notify_all()

    # One worker per slot, slot k on GPU k mod gpus.
    threads = [threading.Thread(target=worker, args=(k % max(1, gpus),)) for k in range(max(1, gpus) * per_gpu)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [t for t in tasks if t.state == "failed"]
    if failed:
        raise SystemExit("failed: " + ", ".join(f"{t.name} ({t.log})" for t in failed))


def train_task(args, name: str, base: str, aqn: bool, lr: float, seed: int, steps: int, save_every: int = 0) -> Task:
    folder = args.out / name
    config = recipe_for(args.model, args.recipe)
    command = [sys.executable, "-m", "qerl.train", "--config", str(config), "--model-name", base, "--dataset",
               str(args.train_data), "--dataset-format", args.format, "--aqn", str(aqn).lower(), "--learning-rate",
               str(lr), "--seed", str(seed), "--max-steps", str(steps), "--output-dir", str(folder), "--temperature",
               str(args.temperature), "--overwrite-output-dir", "true"]  # fmt: skip
    if save_every:
        command += ["--save-strategy", "steps", "--save-steps", str(save_every)]
    done = (folder / "adapter_config.json").exists()
    return Task(
        f"{name} train ({steps} steps, lr {lr:g})", None if done else command + args.train_flags, folder / "log.txt"
    )


def eval_task(args, base: str, adapter: Path | None, protocol: str, out: Path, after: Task | None) -> Task:
    command = [sys.executable, "-m", "eval.gsm8k", "--model", base, "--data", str(args.test_data),
               "--format", EVAL_FORMATS[args.format], "--protocol", protocol, "--max-new-tokens",
               str(args.eval_tokens), "--out", str(out), "--kv-cache-gib", str(args.eval_kv_gib)]  # fmt: skip
    if args.eval_limit:
        command += ["--limit", str(args.eval_limit)]
    if adapter:
        command += ["--adapter", str(adapter)]
    return Task(
        f"{out.parent.name} {out.stem}", None if out.exists() else command, out.parent / "log.txt", after, optional=True
    )


def base_tasks(args, bases: dict[str, str], protocol: str) -> list[Task]:
    """The bases without an adapter under `protocol` (none if the experiment does not evaluate it)."""
    if protocol not in args.protocols:
        return []
    return [
        eval_task(args, folder, None, protocol, args.out / f"base-{precision}" / f"eval-{protocol}.jsonl", None)
        for precision, folder in bases.items()
    ]


# ----------------------------------------------------------------------------------------------------------
# Reading the runs


def metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return plotting.read_metrics(str(path)) if path.exists() else []


def seconds_per_step(folder: Path) -> float | None:
    """A step's wall time once warm: TRL's step_time (rollout, forwards, backward) over the last half of the steps."""
    times = [r["step_time"] for r in metrics(folder) if "step_time" in r]
    return statistics.fmean(times[len(times) // 2 :]) if times else None


def late_reward(rows: list[dict]) -> float:
    """Mean training reward over the last half of the steps: the sweep's criterion."""
    half = rows[len(rows) // 2 :]
    return statistics.fmean(r["reward"] for r in half) if half else float("nan")


def eval_summary(path: Path) -> dict | None:
    if not path.exists():
        return None
    with open(path) as f:
        return json.loads(f.readline())


# ----------------------------------------------------------------------------------------------------------
# Commands


def prepare(args) -> None:
    for precision, folder in checkpoints(args).items():
        print(f"{precision}: {folder}")


def probe(args) -> None:
    """Measure prompt/reward formats and rollout temperatures on training prompts: `--probe-prompts` GSM8K train
    prompts x 8 samples of the BF16 base per candidate, scored by each format's training rewards. DAPO learns only
    from prompt groups whose rewards differ, so the share of such groups is the first thing to compare; the other
    is whether a format's reward pays what the evaluation scores (the recipe says which was taken and why).
    Formats that pose the same prompt (gsm8k_hash, gsm8k_lenient) share one set of samples."""
    from eval.common import GENERATORS, ModelSpec, Sampling
    from qerl import data

    bases = checkpoints(args)
    with open(args.train_data) as f:
        rows = [json.loads(line) for line in f if line.strip()][-args.probe_prompts :]  # the file's end: any rows do
    group = 8
    device = "cuda" if _cuda() else "cpu"
    spec = ModelSpec(bases["bf16"], "bf16", None, device, args.eval_kv_gib)
    samples: dict[tuple[str, float], list[str]] = {}  # (prompt of the first row, temperature) -> completions
    results = {}
    for fmt in args.formats:
        formatted = [data.format_row(row, fmt) for row in rows]
        prompts = [r["prompt"] for r in formatted for _ in range(group)]
        golds = [r["answer"] for r in formatted for _ in range(group)]
        funcs = data.reward_funcs_for(fmt)
        for temperature in args.temperatures:
            key = (json.dumps(formatted[0]["prompt"]), temperature)
            if key not in samples:
                say(f"probe: sampling {len(prompts)} completions at T {temperature:g} ({fmt} prompt)")
                sampling = Sampling(True, temperature, 1.0, args.probe_tokens, args.sweep_seeds[0])
                samples[key] = GENERATORS["auto"](spec, prompts, sampling, args.probe_batch)
            texts = samples[key]
            per_func = {f.__name__: f(texts, answer=golds) for f in funcs}
            totals = [sum(v or 0.0 for v in values) for values in zip(*per_func.values(), strict=True)]
            groups = [totals[i : i + group] for i in range(0, len(totals), group)]
            results[f"{fmt} T{temperature:g}"] = {
                "format": fmt, "temperature": temperature, "mean_reward": statistics.fmean(totals),
                "groups_with_signal": sum(max(g) > min(g) for g in groups) / len(groups),
                "mean_words": statistics.fmean(len(t.split()) for t in texts),
                **{name: statistics.fmean(v or 0.0 for v in values) for name, values in per_func.items()},
            }  # fmt: skip
    most = max(results, key=lambda k: results[k]["groups_with_signal"])
    with open(args.out / "probe.json", "w") as f:
        json.dump(
            {
                "prompts": len(rows),
                "per_prompt": group,
                "max_new_tokens": args.probe_tokens,
                "results": results,
                "most_signal": most,
            },
            f,
            indent=2,
        )
    print(f"\nprobe: {len(rows)} train prompts x {group} samples of the BF16 base, {args.probe_tokens} new tokens")
    for name, r in results.items():
        extras = " ".join(f"{k} {v:.3f}" for k, v in r.items() if k.endswith("reward") and k != "mean_reward")
        print(
            f"  {name:<22} groups with signal {r['groups_with_signal']:.1%}, mean reward {r['mean_reward']:.3f} "
            f"({extras}), {r['mean_words']:.0f} words{'   <- most signal' if name == most else ''}"
        )


def sweep(args) -> None:
    """Each swept arm at each learning rate with the sweep seeds (no train run uses them), `--steps` steps; the rate
    with the highest mean training reward over the last half of the steps (mean over the seeds) is that arm's."""
    bases = checkpoints(args)
    runs = {
        (arm, lr, seed): f"sweep-{arm}-lr{lr:g}-seed{seed}"
        for arm in args.sweep_arms
        for lr in args.lrs
        for seed in args.sweep_seeds
    }
    tasks = [
        train_task(args, name, bases[ARMS[arm][0]], ARMS[arm][1], lr, seed, args.steps)
        for (arm, lr, seed), name in runs.items()
    ]
    run_tasks(tasks, args.gpus, args.per_gpu)
    late = {
        arm: {
            str(lr): statistics.fmean(late_reward(metrics(args.out / runs[arm, lr, seed])) for seed in args.sweep_seeds)
            for lr in args.lrs
        }
        for arm in args.sweep_arms
    }
    chosen = {arm: float(max(late[arm], key=late[arm].get)) for arm in args.sweep_arms}
    # The other arms take the rate of the swept arm of their precision (the paper's rule: a rate per precision).
    for arm, (precision, _) in ARMS.items():
        chosen.setdefault(arm, next((chosen[a] for a in args.sweep_arms if ARMS[a][0] == precision), None))
    timing = {name: seconds_per_step(args.out / name) for name in runs.values()}
    with open(args.out / "sweep.json", "w") as f:
        json.dump(
            {
                "arms": args.sweep_arms,
                "lrs": args.lrs,
                "seeds": args.sweep_seeds,
                "steps": args.steps,
                "runs_at_once": max(1, args.gpus) * args.per_gpu,
                "late_reward": late,
                "chosen_lr": chosen,
                "seconds_per_step": timing,
            },
            f,
            indent=2,
        )
    print(
        f"\nsweep (seeds {args.sweep_seeds}, {args.steps} steps): mean training reward over the last half of the "
        "steps, mean over the seeds"
    )
    print(f"  {'lr':<8}" + "".join(f"{arm:>16}" for arm in args.sweep_arms))
    for lr in args.lrs:
        cells = "".join(f"{late[arm][str(lr)]:>15.3f}{'*' if chosen[arm] == lr else ' '}" for arm in args.sweep_arms)
        print(f"  {lr:<8g}{cells}")
    print("  (* chosen)  seconds per step: " + ", ".join(f"{s:.1f}" for s in timing.values() if s))


def planned_steps(args, sweep_record: dict) -> int:
    """--steps auto: as many steps as end, at the sweep's slowest seconds per step (times --step-margin), before
    --finish-by less --eval-minutes for the evaluations."""
    if args.finish_by is None:
        raise SystemExit("--steps auto needs --finish-by (unix time)")
    per_step = max(s for s in sweep_record["seconds_per_step"].values() if s) * args.step_margin
    left = args.finish_by - time.time() - 60 * args.eval_minutes - args.warmup_seconds
    steps = max(0, int(left // per_step))
    if steps < args.min_steps:
        raise SystemExit(
            f"only {steps} steps of {per_step:.1f} s fit before the deadline (--min-steps {args.min_steps})"
        )
    say(f"train: {steps} steps ({per_step:.1f} s each, {left / 60:.1f} min before the evaluations)")
    return steps


def train(args) -> None:
    bases = checkpoints(args)
    sweep_path = args.out / "sweep.json"
    sweep_record = json.loads(sweep_path.read_text()) if sweep_path.exists() else None
    if (args.lr is None or args.steps == "auto") and sweep_record is None:
        raise SystemExit(f"{sweep_path} not found: run the sweep first, or pass --lr and --steps")
    steps = planned_steps(args, sweep_record) if args.steps == "auto" else int(args.steps)
    save_every = math.ceil(steps / (args.checkpoints + 1)) if args.checkpoints else 0
    trainings, finals, intermediate, reference = [], [], [], []
    for arm in args.arms:
        precision, aqn = ARMS[arm]
        lr = args.lr if args.lr is not None else sweep_record["chosen_lr"][arm]
        for seed in args.seeds:
            name = f"{arm}-seed{seed}"
            first = seed == args.seeds[0]
            trained = train_task(args, name, bases[precision], aqn, lr, seed, steps, save_every if first else 0)
            trainings.append(trained)
            folder = args.out / name
            for protocol in args.protocols:
                task = eval_task(args, bases[precision], folder, protocol, folder / f"eval-{protocol}.jsonl", trained)
                (finals if protocol == "greedy" else reference).append(task)
            for step in range(save_every, steps, save_every) if first and save_every else ():
                out = folder / f"eval-greedy-step{step}.jsonl"
                intermediate.append(
                    eval_task(args, bases[precision], folder / f"checkpoint-{step}", "greedy", out, trained)
                )
    # Evaluations in order of what the report needs most: final greedy and the bases', the curve, the reference
    # protocol (what the deadline leaves out comes last).
    tasks = (
        trainings
        + finals
        + base_tasks(args, bases, "greedy")
        + intermediate
        + reference
        + base_tasks(args, bases, "reference")
    )
    run_tasks(tasks, args.gpus, args.per_gpu, args.finish_by)
    report(args)


# ----------------------------------------------------------------------------------------------------------
# Report


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


# ----------------------------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _names(choices) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x for x in text.split(",") if x]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r}; choose from {', '.join(choices)}")
        return names

    return parse


def _steps(text: str) -> str | int:
    return text if text == "auto" else int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "probe", "sweep", "train", "report"))
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a fetchable model (python -m qerl.models list) or a BF16 checkpoint folder",
    )
    parser.add_argument("--recipe", type=Path, help="training recipe (default: the model's, RECIPES)")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("ckpt"), help="where its BF16 and NVFP4 folders go")
    parser.add_argument("--out", type=Path, default=Path("runs/arms"))
    parser.add_argument("--png", type=Path, help="the report's plot (default: OUT/arms.png)")
    shared = REPO.parent / "shared" / "data" / "gsm8k"
    parser.add_argument("--train-data", type=Path, default=shared / "train.jsonl")
    parser.add_argument("--test-data", type=Path, default=shared / "test.jsonl")
    parser.add_argument(
        "--format",
        default="gsm8k_hash",
        choices=list(EVAL_FORMATS),
        help="training dataset format (its prompt and rewards; the probe's choice)",
    )
    parser.add_argument("--formats", type=_names(EVAL_FORMATS), default=list(EVAL_FORMATS), help="probe: candidates")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature")
    parser.add_argument("--temperatures", type=_floats, default=[1.0], help="probe: candidates")
    parser.add_argument("--probe-prompts", type=int, default=32, help="probe: train prompts per candidate")
    parser.add_argument("--probe-tokens", type=int, default=512, help="probe: new tokens per sample")
    parser.add_argument("--probe-batch", type=int, default=64, help="probe: sequences per batch (CPU generate)")
    parser.add_argument("--arms", type=_names(ARMS), default=list(ARMS), help="train: the arms run")
    parser.add_argument("--steps", type=_steps, default=150, help="steps per run; train: 'auto' fits --finish-by")
    parser.add_argument("--finish-by", type=float, help="unix time by which training and evaluations must end")
    parser.add_argument("--eval-minutes", type=float, default=4.0, help="--steps auto: time kept for evaluations")
    parser.add_argument("--step-margin", type=float, default=1.1, help="--steps auto: on the sweep's seconds per step")
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=60,
        help="--steps auto: a run's start (loading, compiling, the first step) before its steps",
    )
    parser.add_argument("--min-steps", type=int, default=30, help="--steps auto: refuse to train fewer")
    parser.add_argument("--lr", type=float, help="train: one learning rate for all arms (default: the sweep's per arm)")
    parser.add_argument("--lrs", type=_floats, default=[3e-5, 1e-4, 3e-4], help="sweep: learning rates")
    parser.add_argument(
        "--sweep-arms",
        type=_names(ARMS),
        default=["bf16_lora", "nvfp4_lora"],
        help="sweep: the arms swept (the others take the rate of their precision's)",
    )
    parser.add_argument(
        "--sweep-seeds",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[100, 101],
        help="sweep: seeds no train run uses",
    )
    parser.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1, 2])
    parser.add_argument(
        "--checkpoints",
        type=int,
        default=2,
        help="train: intermediate checkpoints of the first seed's runs evaluated (evenly spaced)",
    )
    parser.add_argument("--gpus", type=int, help="GPUs to spread runs over (default: all visible; 0 on CPU)")
    parser.add_argument("--per-gpu", type=int, default=3, help="runs at a time on each GPU")
    parser.add_argument(
        "--protocols", type=_names(PROTOCOLS), default=list(PROTOCOLS), help="eval protocols of every run"
    )
    parser.add_argument("--eval-tokens", type=int, default=512, help="new tokens per eval answer")
    parser.add_argument("--eval-kv-gib", type=float, default=4.0, help="KV cache budget of each eval (GiB)")
    parser.add_argument("--eval-limit", type=int, help="evaluate the first N test problems only (smoke runs)")
    parser.add_argument(
        "--train-flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="the rest of the command line goes to every qerl.train run",
    )
    args = parser.parse_args(argv)
    if args.command == "train" and args.steps == "auto" and args.finish_by is None:
        parser.error("--steps auto needs --finish-by")
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    args.png = args.png or args.out / "arms.png"
    args.out.mkdir(parents=True, exist_ok=True)
    {"prepare": prepare, "probe": probe, "sweep": sweep, "train": train, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
