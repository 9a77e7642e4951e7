"""The rollout/trainer mismatch on real weights: how far each rollout engine's log-probs of the tokens it sampled are
from the trainer's recomputation of them, BF16 and NVFP4, AQN off.

    python -m benchmarks.mismatch --model smollm2-135m-instruct --rollout-backends native,vllm --steps 4
    python -m benchmarks.mismatch --rollout-backends native --kv-cache-dtypes auto,fp8 --steps 4    # FP8 KV's cost

Each (backend, precision) pair is a short `python -m qerl.train` run of the SmolLM2 recipe (its own process, so one
vLLM engine per process) with --aqn false; its metrics.jsonl holds TRL's sampling/* metrics of every step, computed
from the loss forward on the same parameters that sampled: sampling_logp_difference = |logp_rollout - logp_trainer|
per completion token (mean, max), and the importance-sampling ratio exp(logp_trainer - logp_rollout) (min, max).
Prints a table (means over the run's steps) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.launch import SHARED_GSM8K, recipe_for, run_or_raise
from qerl import cli, plotting
from qerl.field_rules import ROLLOUT_BACKENDS
from qerl.models.fetch import bf16_and_nvfp4

METRICS = {
    "logp_diff_mean": ("sampling/sampling_logp_difference/mean", statistics.fmean),
    "logp_diff_max": ("sampling/sampling_logp_difference/max", max),
    "is_ratio_min": ("sampling/importance_sampling_ratio/min", min),
    "is_ratio_max": ("sampling/importance_sampling_ratio/max", max),
    "entropy": ("entropy", statistics.fmean),
    "completion_length": ("completions/mean_length", statistics.fmean),
}


def run(args, backend: str, precision: str, model: str, kv_dtype: str = "auto") -> dict:
    out = args.out / (f"{backend}-{precision}" if kv_dtype == "auto" else f"{backend}-{kv_dtype}kv-{precision}")
    command = [sys.executable, "-m", "qerl.train", "--config", str(recipe_for(args.model)), "--model-name", model,
               "--dataset", str(args.data), "--dataset-format", "gsm8k_hash", "--aqn", "false",
               "--rollout-backend", backend, "--max-steps", str(args.steps), "--seed", str(args.seed),
               "--output-dir", str(out), "--overwrite-output-dir", "true", "--rollout-kv-cache-dtype", kv_dtype,
               *args.train_flags]  # fmt: skip
    start = time.time()
    try:
        run_or_raise(command, out / "log.txt")
    except RuntimeError as err:
        return {"error": str(err)}
    rows = plotting.read_metrics(str(out / "metrics.jsonl"))
    result = {name: fold([r[key] for r in rows if key in r]) for name, (key, fold) in METRICS.items()}
    return {**result, "steps": len(rows), "seconds": time.time() - start}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="fetchable model name or BF16 folder")
    parser.add_argument("--checkpoint-dir", default="ckpt")
    parser.add_argument(
        "--rollout-backends",
        type=cli.comma_list(ROLLOUT_BACKENDS),
        default="native,vllm",
        help="rollout engines to compare, comma-separated",
    )
    parser.add_argument("--precisions", default="bf16,nvfp4")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="native: its KV-cache dtypes to run (auto,fp8)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=SHARED_GSM8K / "train.jsonl")
    parser.add_argument("--out", type=Path, default=Path("runs/mismatch"))
    parser.add_argument("--train-flags", nargs=argparse.REMAINDER, default=[], help="passed to every qerl.train run")
    args = parser.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    folders = dict(zip(("bf16", "nvfp4"), bf16_and_nvfp4(args.model, args.checkpoint_dir, device), strict=True))
    results = {}
    for backend in args.rollout_backends:
        for kv_dtype in args.kv_cache_dtypes.split(",") if backend == "native" else ["auto"]:
            name = backend if kv_dtype == "auto" else f"{backend}+{kv_dtype} KV"
            for precision in args.precisions.split(","):
                results[f"{name}/{precision}"] = run(args, backend, precision, folders[precision], kv_dtype)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "mismatch.json", "w") as f:
        json.dump({"model": args.model, "device": device, "steps": args.steps, "results": results}, f, indent=2)
    print(f"\nrollout vs trainer log-probs, {args.model}, AQN off, {args.steps} steps ({device}):")
    print(
        f"{'backend/precision':<22} {'|dlogp| mean':>13} {'|dlogp| max':>12} {'IS ratio min':>13} "
        f"{'IS ratio max':>13} {'entropy':>8} {'length':>7}"
    )
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<22} {r['error']}")
            continue
        print(
            f"{name:<22} {r['logp_diff_mean']:>13.4f} {r['logp_diff_max']:>12.3f} {r['is_ratio_min']:>13.3f} "
            f"{r['is_ratio_max']:>13.3f} {r['entropy']:>8.3f} {r['completion_length']:>7.1f}"
        )
    return results


if __name__ == "__main__":
    main()
