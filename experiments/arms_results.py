"""Results of experiments.arms: the readers of what a run wrote (metrics.jsonl, an evaluation's summary line), and the
results kept as data: one small JSON record per finished run, committed under results/arms/MODEL/, so that seeds from
several leases add up and a run whose record exists is never run again.

A record holds what the report needs and what says how the run was made: the arm, seed, steps, learning rate and
recipe; the training curve (a few logged keys per step, as columns); the evaluation summaries (no per-sample
answers); the card, how many runs shared it and whether through CUDA MPS; the commit. A base model evaluated
without an adapter is a record too (base-bf16, base-nvfp4). No weights: a record is a few KB.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.launch import REPO
from qerl import plotting

RESULTS = REPO / "results" / "arms"
# The logged keys a record keeps per step (of TRL's ~40): what the report, the plot and a later question need.
CURVE_KEYS = (
    "step",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "grad_norm",
    "loss",
    "learning_rate",
    "step_time",
    "completions/mean_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/truncated_reward_mean",
    "completions/finished_reward_mean",
    "sampling/sampling_logp_difference/mean",
    "aqn/sigma",
)
# What a run's evaluation summary keeps: the scores and how they were made, not the samples or file paths.
SUMMARY_KEYS = ("protocol", "format", "do_sample", "temperature", "top_p", "max_new_tokens", "seed", "examples")
SHARING = ("alone", "shared", "mps")
# A run's adapter evaluated greedily on the other precision's base (a BF16-trained adapter on the NVFP4 base and the
# reverse: what the 4-bit base costs at sampling time apart from what it costs in training). Its file and record key.
OTHER_BASE = "greedy_other_base"  # one run on its GPU; several, time-sliced; several through CUDA MPS


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


def _round(value):
    """Five significant digits, and null for what is not a finite number (JSON has no NaN)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return value
    if not math.isfinite(value):
        return None
    return value if isinstance(value, int) else float(f"{value:.5g}")


def curve(rows: list[dict]) -> dict[str, list]:
    """The kept keys of a run's logged steps as columns (null where a step logged none)."""
    keys = [k for k in CURVE_KEYS if any(k in r for r in rows)]
    return {key: [_round(r.get(key)) for r in rows] for key in keys}


def summary_scores(summary: dict) -> dict:
    """An evaluation summary's scores (every accuracy with its interval) and settings."""
    kept = {k: summary[k] for k in SUMMARY_KEYS if k in summary}
    kept.update({k: v for k, v in summary.items() if k.startswith("accuracy")})
    return kept


@functools.cache
def gpu_name(gpu: int | None) -> str:
    """The card a run used, as nvidia-smi names it ('cpu' without a GPU)."""
    if gpu is None:
        return "cpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", str(gpu)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown GPU"
    return out.stdout.strip() or "unknown GPU"


def software_versions() -> dict[str, str]:
    """The versions of the libraries a figure depends on, as installed (those missing left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "trl", "accelerate", "peft", "deepspeed", "vllm"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def current_commit() -> str:
    """The commit the runs are made from: QERL_COMMIT where the tree is a copy without .git (the GPU machine)."""
    if os.environ.get("QERL_COMMIT"):
        return os.environ["QERL_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def base_record(args, device: str, commit: str, program: str, argv: list[str] | None) -> dict:
    """What a record of one BF16 model's measurement opens with (base_quality, layer_sensitivity): its name (--name,
    else the --bf16 folder's), the card, the commit, the command that made it, the data and the dtype."""
    import torch

    return {
        "name": args.name or args.bf16.rstrip("/").rsplit("/", 1)[-1],
        "card": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "commit": commit,
        "software": software_versions(),
        "command": f"python -m {program} " + " ".join(sys.argv[1:] if argv is None else argv),
        "data": args.data,
        "dtype": args.dtype,
        "bf16": args.bf16,
    }


def record_path(results: Path, name: str) -> Path:
    return results / f"{name}.json"


def run_record(folder: Path, setting: dict, protocols: tuple[str, ...]) -> dict:
    """The record of a finished run: `setting` (arm, seed, steps, lr, ... as the runner knows them), its training
    curve from metrics.jsonl (none for a base), the summary of each protocol's evaluation in the folder and, where
    it was made, the greedy evaluation on the other base (OTHER_BASE, with that base's precision)."""
    evals = {}
    for protocol in protocols:
        summary = eval_summary(folder / f"eval-{protocol}.jsonl")
        if summary is None:
            raise FileNotFoundError(f"{folder / f'eval-{protocol}.jsonl'}: the run's evaluation is missing")
        evals[protocol] = summary_scores(summary)
    checkpoints = {
        int(p.stem.removeprefix("eval-greedy-step")): eval_summary(p)["accuracy"]
        for p in folder.glob("eval-greedy-step*.jsonl")
    }
    other = eval_summary(folder / f"eval-{OTHER_BASE}.jsonl")
    if other is not None:
        evals[OTHER_BASE] = {
            **summary_scores(other),
            "base": "bf16" if setting.get("precision") == "nvfp4" else "nvfp4",
        }
    record = {**setting, "name": folder.name, "date": time.strftime("%Y-%m-%d"), "evals": evals}
    if setting.get("arm") is not None:
        record["curve"] = curve(metrics(folder))
    if checkpoints:
        record["checkpoint_greedy_accuracy"] = dict(sorted(checkpoints.items()))
    return record


def record_text(record: dict) -> str:
    """Strict JSON, one top-level key per line (a curve's column on its line): readable in a diff, a few KB."""
    lines = [f"{json.dumps(key)}: {json.dumps(value, allow_nan=False)}" for key, value in record.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_record(path: Path, record: dict) -> None:
    """Written whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
    tmp.write_text(record_text(record))
    os.replace(tmp, path)


def write_report(folder: Path, stem: str, result: dict, text: str) -> str:
    """A report's numbers as STEM.json and its tables as STEM.md in `folder`, the tables printed; returns where."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (folder / f"{stem}.md").write_text(text)
    print(text)
    return f"{folder / f'{stem}.json'}, {folder / f'{stem}.md'}"


def load_records(results: Path) -> list[dict]:
    """Every record under `results`, in name order; a file that is not a record is named in the error."""
    records = []
    for path in sorted(results.glob("*.json")) if results.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise SystemExit(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
        missing = [k for k in ("name", "arm", "evals") if k not in record]
        if missing:
            raise SystemExit(f"{path}: not a run record (no {', '.join(missing)})")
        if record["arm"] is not None and "curve" not in record:
            raise SystemExit(f"{path}: a trained run's record without its training curve")
        if record.get("sharing", "alone") not in SHARING:
            raise SystemExit(f"{path}: sharing {record['sharing']!r}, expected one of {', '.join(SHARING)}")
        records.append(record)
    return records


def curve_rows(record: dict) -> list[dict]:
    """A record's training curve back as one dict per step (the shape metrics.jsonl had)."""
    columns = record["curve"]
    return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def logged(row: dict, key: str) -> float:
    """A logged number; NaN where the step logged none (TRL logs no entropy when every token is masked)."""
    value = row.get(key)
    return float("nan") if value is None else float(value)


def first_nonfinite_step(rows: list[dict]) -> int | None:
    """The first step whose gradient norm was not finite: the adapter is NaN from there on."""
    return next((r["step"] for r in rows if not math.isfinite(logged(r, "grad_norm"))), None)
