"""experiments.arms' inputs as the tests make them: a finished run's folder as qerl.train and eval.gsm8k leave it
(tests/tools/experiments/test_arms_results.py, test_arms_report.py, test_arms.py) and the command line's namespace
(test_arms_runs.py, test_arms.py)."""

import argparse
import json
import math

from experiments import arms_runs


def _curve(rewards, nan_from=None, step_time=2.0, truncated_from=None):
    rows = []
    for step, reward in enumerate(rewards, 1):
        broken = nan_from is not None and step >= nan_from
        truncated = truncated_from is not None and step >= truncated_from
        rows.append(
            {
                "step": step,
                "loss": 0.0,
                "reward": 0.0 if broken else reward,
                "step_time": step_time,
                "grad_norm": math.nan if broken else 0.3,
                "entropy": None if broken and step > nan_from else 0.7,
                "completions/clipped_ratio": 1.0 if truncated else 0.05,
                "rewards/format_reward/mean": 0.2,  # a logged key the record leaves out
            }
        )
    return rows


def _run(
    folder, rewards, nan_from=None, accuracy=0.01, step_time=2.0, protocols=arms_runs.PROTOCOLS, truncated_from=None
):
    """A finished run's folder as qerl.train and eval.gsm8k leave it: metrics.jsonl (NaN as JSON's NaN, as json.dumps
    writes TRL's log lines) and each protocol's evaluation (summary line, then a sample)."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in _curve(rewards, nan_from, step_time, truncated_from))
    for protocol in protocols:
        summary = {
            "protocol": protocol,
            "examples": 100,
            "accuracy": accuracy,
            "accuracy_ci95": [0.0, 0.02],
            "accuracy_flexible": 2 * accuracy,
            "accuracy_flexible_ci95": [0.0, 0.03],
            "model": "/tmp/x",
        }
        sample = {"index": 0, "completion": "#### 3", "correct": True}
        (folder / f"eval-{protocol}.jsonl").write_text(json.dumps(summary) + "\n" + json.dumps(sample) + "\n")


def _args(tmp_path, **overrides):
    args = argparse.Namespace(
        model="qwen2.5-coder-1.5b-instruct",
        recipe=None,
        out=tmp_path,
        train_data="train.jsonl",
        test_data="test.jsonl",
        format="gsm8k_hash",
        temperature=1.0,
        train_flags=["--x"],
        eval_tokens=512,
        eval_kv_gib=4.0,
        eval_limit=None,
        finish_by=None,
        eval_minutes=4.0,
        step_margin=1.1,
        warmup_seconds=60,
        min_steps=30,
        per_gpu=1,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args
