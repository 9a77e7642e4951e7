"""The paper's comparison in miniature on a real model: BF16 + LoRA vs NVFP4 + LoRA vs NVFP4 + LoRA + AQN.

    python -m experiments.arms probe --temperatures 1.0,0.7                       (the rollout temperature)
    python -m experiments.arms sweep --temperature 0.7 --lrs 1e-5,3e-5,1e-4,3e-4 --steps 30   (one arm, one seed)
    python -m experiments.arms train --temperature 0.7 --lr 3e-4 --steps 80 --seeds 0,1,2     (arms x seeds)
    python -m experiments.arms report                                             (table, JSON and PNG)

Each run is `python -m qerl.train` with the recipe configs/smollm2_gsm8k_hash.yaml on the GSM8K train file, then
`python -m eval.gsm8k` of its final adapter on the GSM8K test file (every problem, gsm8k_hash format, greedy and
the reference protocol), each run in its own process, `--parallel` at a time on one GPU (a 135M model leaves most
of it idle). `train` also evaluates the two bases without an adapter. Runs whose outputs exist are skipped, so
an interrupted experiment continues where it stopped.

The temperature and the learning rate are chosen on training prompts and training reward, never on the test set.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from qerl import plotting

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "smollm2_gsm8k_hash.yaml"
# arm -> (base checkpoint precision, AQN on)
ARMS = {"bf16_lora": ("bf16", False), "nvfp4_lora": ("nvfp4", False), "nvfp4_lora_aqn": ("nvfp4", True)}
PROTOCOLS = ("greedy", "reference")
ACCURACIES = ("accuracy", "accuracy_flexible")  # eval.gsm8k's gsm8k_hash format: strict "#### N", and lenient
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


def run_logged(command: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        raise RuntimeError(f"exit code {code}: {' '.join(command[:4])} ... (log: {log})")


def train_command(args, base: str, aqn: bool, lr: float, seed: int, steps: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "qerl.train", "--config", str(RECIPE), "--model-name", base,
            "--dataset", str(args.train_data), "--dataset-format", args.format, "--aqn", str(aqn).lower(),
            "--learning-rate", str(lr), "--seed", str(seed), "--max-steps", str(steps), "--output-dir", str(out),
            "--temperature", str(args.temperature), "--overwrite-output-dir", "true", *args.train_flags]  # fmt: skip


def eval_command(args, base: str, adapter: Path | None, protocol: str, out: Path) -> list[str]:
    command = [sys.executable, "-m", "eval.gsm8k", "--model", base, "--data", str(args.test_data),
               "--format", "gsm8k_hash", "--protocol", protocol, "--max-new-tokens", str(args.eval_tokens),
               "--out", str(out), "--kv-cache-gib", str(args.eval_kv_gib)]  # fmt: skip
    if args.eval_limit:
        command += ["--limit", str(args.eval_limit)]
    return command + (["--adapter", str(adapter)] if adapter else [])


def job(args, name: str, base: str, aqn: bool | None, lr: float, seed: int, steps: int, evaluate: bool) -> None:
    """Train (unless aqn is None: a bare base) and evaluate one run under args.out/name."""
    folder = args.out / name
    log = folder / "log.txt"
    start = time.time()
    adapter = None
    if aqn is not None:
        adapter = folder
        if not (folder / "adapter_config.json").exists():
            say(f"{name}: training ({steps} steps, lr {lr:g}, seed {seed})")
            run_logged(train_command(args, base, aqn, lr, seed, steps, folder), log)
    for protocol in args.protocols if evaluate else ():
        out = folder / f"eval-{protocol}.jsonl"
        if not out.exists():
            run_logged(eval_command(args, base, adapter, protocol, out), log)
    say(f"{name}: done in {time.time() - start:.0f} s")


def run_jobs(args, jobs: list[tuple]) -> None:
    failures = []
    with ThreadPoolExecutor(args.parallel) as pool:
        futures = {pool.submit(job, args, *spec): spec[0] for spec in jobs}
        for future, name in futures.items():
            try:
                future.result()
            except RuntimeError as err:
                failures.append(f"{name}: {err}")
    if failures:
        raise SystemExit("failed runs:\n  " + "\n  ".join(failures))


# ----------------------------------------------------------------------------------------------------------
# Reading the runs


def metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return plotting.read_metrics(str(path)) if path.exists() else []


def late_reward(rows: list[dict]) -> float:
    """Mean training reward over the last half of the steps: the sweep's criterion."""
    half = rows[len(rows) // 2 :]
    return statistics.fmean(r["reward"] for r in half) if half else float("nan")


def eval_summary(folder: Path, protocol: str) -> dict | None:
    path = folder / f"eval-{protocol}.jsonl"
    if not path.exists():
        return None
    with open(path) as f:
        return json.loads(f.readline())


def probe(args) -> None:
    """Choose the rollout temperature on training prompts: at each candidate, `--probe-prompts` GSM8K train prompts
    x num_generations samples from the BF16 base, scored by the training rewards; DAPO learns only from prompt
    groups whose rewards differ, so the temperature with the largest share of such groups wins."""
    from eval.common import ModelSpec, Sampling, native_generate
    from qerl import data, rewards

    bases = checkpoints(args)
    with open(args.train_data) as f:
        rows = [json.loads(line) for line in f if line.strip()][-args.probe_prompts :]  # the file's end: any rows do
    group = 8
    prompts = [data.gsm8k_hash_prompt(r["question"]) for r in rows for _ in range(group)]
    golds = [rewards.gsm8k_gold(r["answer"]) for r in rows for _ in range(group)]
    funcs = data.reward_funcs_for(args.format)
    results = {}
    spec = ModelSpec(bases["bf16"], "bf16", None, "cuda" if _cuda() else "cpu", args.eval_kv_gib)
    for temperature in args.temperatures:
        texts = native_generate(spec, prompts, Sampling(True, temperature, 1.0, 256, args.sweep_seed), len(prompts))
        per_func = {f.__name__: f(texts, answer=golds) for f in funcs}
        totals = [sum(values) for values in zip(*per_func.values(), strict=True)]
        groups = [totals[i : i + group] for i in range(0, len(totals), group)]
        results[str(temperature)] = {
            "mean_reward": statistics.fmean(totals),
            "groups_with_signal": sum(max(g) > min(g) for g in groups) / len(groups),
            **{name: statistics.fmean(v) for name, v in per_func.items()},
        }
    chosen = max(args.temperatures, key=lambda t: results[str(t)]["groups_with_signal"])
    with open(args.out / "probe.json", "w") as f:
        json.dump({"format": args.format, "prompts": len(rows), "per_prompt": group, "results": results,
                   "chosen_temperature": chosen}, f, indent=2)  # fmt: skip
    print(f"\nprobe: {len(rows)} train prompts x {group} samples of the BF16 base, rewards of {args.format}")
    for temperature in args.temperatures:
        r = results[str(temperature)]
        extras = " ".join(f"{name} {r[name]:.3f}" for name in per_func)
        print(f"  T {temperature:<4g} groups with signal {r['groups_with_signal']:.1%}, mean reward "
              f"{r['mean_reward']:.3f} ({extras}){'   <- chosen' if temperature == chosen else ''}")  # fmt: skip


def sweep(args) -> None:
    bases = checkpoints(args)
    base, aqn = ARMS[args.arm]
    runs = [(f"sweep-{args.arm}-lr{lr:g}", bases[base], aqn, lr, args.sweep_seed, args.steps, False) for lr in args.lrs]
    run_jobs(args, runs)
    rows = [(lr, late_reward(metrics(args.out / name))) for name, _, _, lr, *_ in runs]
    best = max(rows, key=lambda row: row[1])
    print(f"\nsweep ({args.arm}, seed {args.sweep_seed}, {args.steps} steps): mean training reward, last half of steps")
    for lr, reward in rows:
        print(f"  lr {lr:<8g} {reward:.4f}{'   <- chosen' if (lr, reward) == best else ''}")
    with open(args.out / "sweep.json", "w") as f:
        json.dump({"arm": args.arm, "seed": args.sweep_seed, "steps": args.steps,
                   "late_reward": {str(lr): r for lr, r in rows}, "chosen_lr": best[0]}, f, indent=2)  # fmt: skip


def train(args) -> None:
    bases = checkpoints(args)
    jobs = [(f"{arm}-seed{seed}", bases[base], aqn, args.lr, seed, args.steps, True)
            for seed in args.seeds for arm, (base, aqn) in ARMS.items()]  # fmt: skip
    jobs += [(f"base-{precision}", folder, None, 0.0, 0, 0, True) for precision, folder in bases.items()]
    run_jobs(args, jobs)
    report(args)


# ----------------------------------------------------------------------------------------------------------
# Report


def _mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and the sample standard deviation across seeds (0 for one seed)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _value(row: dict, key: str) -> float:
    """A logged number; NaN where the step logged none (TRL logs no entropy when every token is masked)."""
    value = row.get(key)
    return float("nan") if value is None else float(value)


def first_nonfinite_step(rows: list[dict]) -> int | None:
    """The first step whose gradient norm was not finite: the adapter is NaN from there on."""
    return next((r["step"] for r in rows if not math.isfinite(_value(r, "grad_norm"))), None)


def plot(args, runs: dict[str, list[list[dict]]], png: Path) -> None:
    """Reward and entropy per step, per arm: mean over seeds (line), min-max (band), a moving average; an x marks
    the step where a run's gradient first went non-finite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "training reward"), ("entropy", "token entropy (nats)")]
    window = max(1, max(len(rows) for seeds in runs.values() for rows in seeds) // 15)
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for arm, seeds in runs.items():
            steps = min(len(rows) for rows in seeds)
            curves = [plotting.smooth([_value(r, key) for r in rows[:steps]], window) for rows in seeds]
            columns = [[c[i] for c in curves] for i in range(steps)]
            x = [r["step"] for r in seeds[0][:steps]]
            (line,) = ax.plot(x, [statistics.fmean(c) for c in columns], label=f"{arm} ({len(seeds)} seeds)")
            ax.fill_between(x, [min(c) for c in columns], [max(c) for c in columns], color=line.get_color(),
                            alpha=0.2, linewidth=0)  # fmt: skip
            for rows in seeds:
                bad = first_nonfinite_step(rows)
                if bad is not None and key == "reward":
                    ax.plot([bad], [0], marker="x", color=line.get_color(), markersize=9, linestyle="none")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{Path(args.model).name}, GSM8K ({args.format}), DAPO: mean over seeds (line), min-max (band), "
                 f"moving average of {window} steps; x: first non-finite gradient", fontsize=9)  # fmt: skip
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _tenth(rows: list[dict], key: str, last: bool = False) -> float:
    k = max(1, len(rows) // 10)
    values = [_value(r, key) for r in (rows[-k:] if last else rows[:k])]
    return statistics.fmean(values)


def report(args) -> dict:
    """report.json, the PNG and a table: per arm the training reward (first and last tenth of steps, mean and sd
    over seeds), the steps where gradients went non-finite, and GSM8K test accuracy (strict: "#### N" right;
    flexible: the lenient training criterion) per protocol; the bases without training for reference."""
    names = sorted(p.name for p in args.out.iterdir() if p.is_dir()) if args.out.is_dir() else []
    curves: dict[str, list[list[dict]]] = {}
    table = {}
    for arm in ARMS:
        folders = [args.out / n for n in names if n.startswith(f"{arm}-seed")]
        curves[arm] = [rows for rows in (metrics(f) for f in folders) if rows]
        row = table[arm] = {"runs": [f.name for f in folders]}
        if curves[arm]:
            row["reward_first_tenth"] = _mean_spread([_tenth(rows, "reward") for rows in curves[arm]])
            row["reward_last_tenth"] = _mean_spread([_tenth(rows, "reward", last=True) for rows in curves[arm]])
            row["entropy_first_tenth"] = _mean_spread([_tenth(rows, "entropy") for rows in curves[arm]])
            row["first_nonfinite_grad_step"] = [first_nonfinite_step(rows) for rows in curves[arm]]
        for protocol in PROTOCOLS:
            summaries = [s for s in (eval_summary(f, protocol) for f in folders) if s]
            if summaries:
                row[protocol] = {key: _mean_spread([s[key] for s in summaries]) for key in ACCURACIES}
                row[protocol]["per_seed"] = [{key: (s[key], *s[f"{key}_ci95"]) for key in ACCURACIES}
                                             for s in summaries]  # fmt: skip
    for precision in ("bf16", "nvfp4"):
        folder = args.out / f"base-{precision}"
        table[f"base-{precision}"] = {p: eval_summary(folder, p) for p in PROTOCOLS}
    with open(args.out / "report.json", "w") as f:
        json.dump(table, f, indent=2)
    if any(curves.values()):
        plot(args, {arm: seeds for arm, seeds in curves.items() if seeds}, args.png)

    header = " ".join(f"{p + ' strict / flexible':<30}" for p in PROTOCOLS)
    print(f"\n{'arm':<16} {'reward first -> last tenth':<28} {'non-finite grad at':<20} {header}")
    for arm in ARMS:
        row = table[arm]
        if "reward_first_tenth" not in row:
            continue
        (f_mean, f_sd), (l_mean, l_sd) = row["reward_first_tenth"], row["reward_last_tenth"]
        cells = [" / ".join(f"{row[p][key][0]:.2%}" for key in ACCURACIES) if p in row else "-" for p in PROTOCOLS]
        bad = ",".join("-" if b is None else str(b) for b in row["first_nonfinite_grad_step"])
        print(f"{arm:<16} {f'{f_mean:.3f}±{f_sd:.3f} -> {l_mean:.3f}±{l_sd:.3f}':<28} {bad:<20} "
              + " ".join(f"{c:<30}" for c in cells))  # fmt: skip
    for precision in ("bf16", "nvfp4"):
        summaries = table[f"base-{precision}"]
        cells = [" / ".join(f"{s[key]:.2%}" for key in ACCURACIES) if s else "-" for s in summaries.values()]
        print(f"{'base ' + precision:<16} {'(no training)':<28} {'':<20} " + " ".join(f"{c:<30}" for c in cells))
    print(f"report: {args.out / 'report.json'}; plot: {args.png}")
    return table


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("probe", "sweep", "train", "report"))
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="a fetchable model (python -m qerl.models list) or a BF16 checkpoint folder")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("ckpt"), help="where its BF16 and NVFP4 folders go")
    parser.add_argument("--out", type=Path, default=Path("runs/arms"))
    parser.add_argument("--png", type=Path, default=Path("runs/arms/arms.png"))
    data = REPO.parent / "shared" / "data" / "gsm8k"
    parser.add_argument("--train-data", type=Path, default=data / "train.jsonl")
    parser.add_argument("--test-data", type=Path, default=data / "test.jsonl")
    parser.add_argument("--format", default="gsm8k_lenient", help="training dataset format (its prompt and rewards)")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (the probe's choice)")
    parser.add_argument("--temperatures", type=_floats, default=[1.0, 0.7], help="probe: candidates")
    parser.add_argument("--probe-prompts", type=int, default=64, help="probe: train prompts per candidate")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3e-5, help="train: the learning rate (the sweep's choice)")
    parser.add_argument("--lrs", type=_floats, default=[1e-5, 3e-5, 1e-4], help="sweep: learning rates")
    parser.add_argument("--arm", choices=list(ARMS), default="nvfp4_lora", help="sweep: the arm swept")
    parser.add_argument("--sweep-seed", type=int, default=100, help="sweep: its seed (not one of the train seeds)")
    parser.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=6, help="runs at a time")
    parser.add_argument("--protocols", type=lambda t: t.split(","), default=list(PROTOCOLS),
                        help=f"eval protocols of every run (of {', '.join(PROTOCOLS)})")
    parser.add_argument("--eval-tokens", type=int, default=512, help="new tokens per eval answer")
    parser.add_argument("--eval-kv-gib", type=float, default=6.0, help="KV cache budget of each eval (GiB)")
    parser.add_argument("--eval-limit", type=int, help="evaluate the first N test problems only (smoke runs)")
    parser.add_argument("--train-flags", nargs=argparse.REMAINDER, default=[],
                        help="the rest of the command line goes to every qerl.train run")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    {"probe": probe, "sweep": sweep, "train": train, "report": report}[args.command](args)


if __name__ == "__main__":
    main()
