"""The paper's comparison in miniature on a real model: BF16 / NVFP4 base, LoRA, AQN on or off, seeds, intervals.

    python -m experiments.arms prepare --model smollm2-135m-instruct    # fetch it, quantize it to NVFP4
    python -m experiments.arms probe --model smollm2-135m-instruct --formats gsm8k,gsm8k_hash,gsm8k_lenient
    python -m experiments.arms sweep --model smollm2-135m-instruct --lrs 3e-5,1e-4,3e-4 --steps 25
    python -m experiments.arms train --model smollm2-135m-instruct --seeds 0,1,2 --steps 51 --mps --bases
    python -m experiments.arms train --model smollm2-135m-instruct --arms bf16_lora,nvfp4_lora --other-base
    python -m experiments.arms train --model smollm2-135m-instruct --arms nvfp4_gptq_lora,nvfp4_lora   # GPTQ base
    python -m experiments.arms train --model smollm2-135m-instruct --arms nvfp4_lora_ahead   # rounds one ahead
    python -m experiments.arms report --model smollm2-135m-instruct    # tables, JSON and PNG from the records

probe compares prompt formats and their rewards, sweep each arm's learning rate, train the arms x seeds (each run
evaluated).

Each run is `python -m qerl.train` with the model's recipe (benchmarks.launch.RECIPES, or --recipe) on the GSM8K
train file, then `python -m eval.gsm8k` of its adapter on the GSM8K test file (every problem, greedy and the
reference protocol), each in its own process, `--per-gpu` at a time on each of the `--gpu-ids` GPUs (one run leaves
most of a GPU idle; with --mps they share its SMs). Once evaluated, a run is recorded as data under --results
(default results/arms/MODEL, committed: experiments/arms_results.py), and a recorded run is never run again, so
seeds from several leases add up; `report` reads only the records. Outputs in --out are skipped too, so an
interrupted experiment continues where it stopped.

The format, the temperature and the learning rates are chosen on training prompts and training reward, never on
the test set. `train --steps auto --finish-by T` sizes the runs from the sweep's seconds per step so that training
and the evaluations end by the time T (a lent machine that goes back at a fixed time); with fixed --steps,
--run-minutes keeps a run from starting when it would end after T. experiments/arms_seeds.sh runs seeds on a lent
machine of four GPUs.

This module holds the phases and the command line; the runs (the arms, each run's command, the runner on GPU slots,
the readers of their outputs) are in experiments/arms_runs.py, the records in experiments/arms_results.py, the
report (tables, comparisons, plot) in experiments/arms_report.py and its statistics in experiments/arms_stats.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from benchmarks.launch import run_or_raise
from experiments.arms_flags import build_parser
from experiments.arms_report import report
from experiments.arms_results import RESULTS, late_reward, metrics, record_path, seconds_per_step
from experiments.arms_runs import (
    ARMS,
    SAMPLED_AHEAD,
    RunPace,
    eval_tasks,
    experiment_setting,
    mps_daemon,
    precision_of,
    run_group,
    run_tasks,
    say,
    train_task,
)


def checkpoints(args, arms: Iterable[str] = ()) -> dict[str, str]:
    """The bases by name (ARMS): BF16 and NVFP4 always, made once; the GPTQ-rounded NVFP4 base beside them where one
    of `arms` takes it (calibrated on --train-data's last solutions, as `qerl.quantize --gptq-calibration`)."""
    from qerl.models.fetch import bf16_and_nvfp4

    device = "cuda" if _cuda() else "cpu"
    bf16, nvfp4 = bf16_and_nvfp4(args.model, args.checkpoint_dir, device)
    bases = {"bf16": bf16, "nvfp4": nvfp4}
    if any(ARMS[arm][0] == "nvfp4_gptq" for arm in arms):
        bases["nvfp4_gptq"] = str(Path(args.checkpoint_dir) / f"{Path(bf16).name}-nvfp4-gptq")
        if not Path(bases["nvfp4_gptq"]).exists():  # qerl.quantize writes the folder whole or not at all
            run_or_raise([sys.executable, "-m", "qerl.quantize", "--model", bf16, "--output", bases["nvfp4_gptq"],
                          "--device", device, "--gptq-calibration", str(args.train_data)],
                         Path(args.out) / "gptq-base.log")  # fmt: skip
    return bases


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


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
    from eval.generate import ModelSpec, generate
    from eval.protocols import Sampling
    from qerl import data

    bases = checkpoints(args)
    with open(args.train_data) as f:
        rows = [json.loads(line) for line in f if line.strip()][-args.probe_prompts :]  # the file's end: any rows do
    group = 8
    device = "cuda" if _cuda() else "cpu"
    spec = ModelSpec(bases["bf16"], "bf16", None, device, args.eval_kv_gib, batch_size=args.probe_batch)
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
                samples[key] = generate(spec, prompts, sampling)
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
    bases = checkpoints(args, args.sweep_arms)
    runs = {
        (arm, lr, seed): f"sweep-{arm}-lr{lr:g}-seed{seed}"
        for arm in args.sweep_arms
        for lr in args.lrs
        for seed in args.sweep_seeds
    }
    tasks = [
        train_task(args, name, bases[ARMS[arm][0]], ARMS[arm][1], lr, seed, args.steps, ahead=arm in SAMPLED_AHEAD)
        for (arm, lr, seed), name in runs.items()
    ]
    with mps_daemon(args.out) if args.mps else contextlib.nullcontext({}) as env:
        run_tasks(tasks, args.gpu_ids, args.per_gpu, env=env)
    late = {
        arm: {
            str(lr): statistics.fmean(late_reward(metrics(args.out / runs[arm, lr, seed])) for seed in args.sweep_seeds)
            for lr in args.lrs
        }
        for arm in args.sweep_arms
    }
    chosen = {arm: float(max(late[arm], key=late[arm].get)) for arm in args.sweep_arms}
    # The other arms take the rate of the swept arm of their precision (the paper's rule: a rate per precision).
    for arm, (base, _) in ARMS.items():
        same = (a for a in args.sweep_arms if precision_of(ARMS[a][0]) == precision_of(base))
        chosen.setdefault(arm, next((chosen[a] for a in same), None))
    timing = {name: seconds_per_step(args.out / name) for name in runs.values()}
    with open(args.out / "sweep.json", "w") as f:
        json.dump(
            {
                "arms": args.sweep_arms,
                "lrs": args.lrs,
                "seeds": args.sweep_seeds,
                "steps": args.steps,
                "runs_at_once": max(1, len(args.gpu_ids)) * args.per_gpu,
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
    """Each arm x seed (seeds first: every arm's first seeds before any arm's later ones), evaluated under each
    protocol, its record written to --results as soon as its greedy evaluation is in. Runs whose record is there are
    not run again; with --bases the bases are evaluated too, once (their records: base-bf16, base-nvfp4)."""
    bases = checkpoints(args, args.arms)
    sweep_path = args.out / "sweep.json"
    sweep_record = json.loads(sweep_path.read_text()) if sweep_path.exists() else None
    if (args.lr is None or args.steps == "auto") and sweep_record is None:
        raise SystemExit(f"{sweep_path} not found: run the sweep first, or pass --lr and --steps")
    steps = planned_steps(args, sweep_record) if args.steps == "auto" else int(args.steps)
    save_every = math.ceil(steps / (args.checkpoints + 1)) if args.checkpoints else 0
    setting = experiment_setting(args, steps)
    suffix = "" if setting["sharing"] == "mps" else f"-{setting['sharing']}"  # a run made otherwise is apart
    runs, kept = [], []
    pace = RunPace(60 * args.run_minutes) if args.run_minutes else None
    for seed in args.seeds:
        for arm in args.arms:
            name = f"{arm}-seed{seed}{suffix}"
            if record_path(args.results, name).exists():
                kept.append(name)
                continue
            base, aqn = ARMS[arm]
            precision = precision_of(base)
            lr = args.lr if args.lr is not None else sweep_record["chosen_lr"][arm]
            first = seed == args.seeds[0]
            every = save_every if first else 0
            trained = train_task(args, name, bases[base], aqn, lr, seed, steps, every, ahead=arm in SAMPLED_AHEAD)
            trained.expected_seconds = pace.estimate if pace else None
            run = {**setting, "arm": arm, "precision": precision, "base": base, "aqn": aqn, "seed": seed, "lr": lr}
            other = bases["nvfp4" if precision == "bf16" else "bf16"] if args.other_base else None
            runs.append(run_group(args, name, bases[base], trained, run, every, steps, pace, other))
    if kept:
        say(f"train: {len(kept)} run(s) already recorded in {args.results}, not run again: {', '.join(kept)}")
    tasks = []  # the bases first: four short evaluations that delay only the first runs
    for precision, folder in bases.items() if args.bases else ():
        name = f"base-{precision}"
        if not record_path(args.results, name).exists():
            base = {**setting, "arm": None, "precision": precision, "seed": None}
            tasks += eval_tasks(args, name, folder, None, args.out / name, None, base, None)
    tasks += [t for group in runs for t in group]
    with mps_daemon(args.out) if args.mps else contextlib.nullcontext({}) as env:
        run_tasks(tasks, args.gpu_ids, args.per_gpu, args.finish_by, env)
    report(args)


# ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    if args.command == "train" and args.steps == "auto" and args.finish_by is None:
        parser.error("--steps auto needs --finish-by")
    if args.gpu_ids is None:
        import torch

        args.gpu_ids = list(range(torch.cuda.device_count()))
    if args.mps and not args.gpu_ids:
        parser.error("--mps needs GPUs")
    args.results = args.results or RESULTS / Path(args.model).name.removesuffix("-nvfp4")
    args.png = args.png or args.out / "arms.png"
    args.out.mkdir(parents=True, exist_ok=True)
    {"prepare": prepare, "probe": probe, "sweep": sweep, "train": train, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
