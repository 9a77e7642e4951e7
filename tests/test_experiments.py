"""experiments.arms: the report (arms_report.py: per-arm reward, entropy, steps to a reward level, non-finite
gradient steps, accuracies per seed and over seeds), the commands each run is and the scheduler that puts runs on GPU
slots (arms_runs.py), the step count fitted to a deadline (arms.py); and the whole sweep -> train -> report road on
the tiny model, the 1.5B recipe shrunk."""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import pytest

from experiments import arms, arms_runs

DATA = Path(__file__).parent / "data" / "gsm8k"


def _run(folder, rewards, nan_from=None, accuracy=0.01, step_time=2.0):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, reward in enumerate(rewards, 1):
            broken = nan_from is not None and step >= nan_from
            row = {
                "step": step,
                "loss": 0.0,
                "reward": 0.0 if broken else reward,
                "step_time": step_time,
                "grad_norm": math.nan if broken else 0.3,
                "entropy": None if broken and step > nan_from else 0.7,
            }
            f.write(json.dumps(row) + "\n")  # NaN as JSON's NaN, as json.dumps writes TRL's log lines
    for protocol in arms_runs.PROTOCOLS:
        summary = {"accuracy": accuracy, "accuracy_ci95": [0.0, 0.02], "accuracy_flexible": 2 * accuracy,
                   "accuracy_flexible_ci95": [0.0, 0.03]}  # fmt: skip
        (folder / f"eval-{protocol}.jsonl").write_text(json.dumps(summary) + "\n")


def test_report_tables_nonfinite_steps_accuracies_and_draws(tmp_path, capsys):
    out = tmp_path / "arms"
    _run(out / "bf16_lora-seed0", [0.05] * 10 + [0.2] * 10)
    _run(out / "bf16_lora-seed1", [0.05] * 10 + [0.2] * 10, nan_from=15, accuracy=0.0)
    _run(out / "nvfp4_lora_aqn-seed0", [0.07] * 10 + [0.3] * 10, accuracy=0.02)
    (out / "nvfp4_lora_aqn-seed0" / "eval-greedy-step10.jsonl").write_text(json.dumps({"accuracy": 0.015}) + "\n")
    _run(out / "base-bf16", [], accuracy=0.003)
    _run(out / "base-nvfp4", [], accuracy=0.004)
    arms.main(["report", "--out", str(out), "--png", str(tmp_path / "arms.png"), "--seeds", "0,1"])
    report = json.loads((out / "report.json").read_text())
    bf16 = report["bf16_lora"]
    assert bf16["first_nonfinite_grad_step"] == [None, 15]
    assert bf16["reward_first_tenth"] == [0.05, 0.0] and bf16["reward_last_tenth"][0] == 0.1  # (0.2 + 0.0) / 2
    # Mean over the two seeds and the half-width of its t interval: t(0.975, 1) * sd / sqrt(2).
    assert bf16["greedy"]["accuracy"] == [0.005, pytest.approx(12.706 * 0.01 / math.sqrt(2) / math.sqrt(2))]
    assert bf16["greedy"]["per_seed"][0]["accuracy"] == [0.01, 0.0, 0.02]  # with its Wilson interval
    aqn = report["nvfp4_lora_aqn"]
    assert aqn["reference"]["accuracy_flexible"] == [0.04, 0.0]
    assert aqn["accuracy_curve"] == [[0, 0.004], [10, 0.015], [20, 0.02]]  # base, checkpoint, final
    # The level is 90% of the lowest arm's last-tenth reward (BF16: 0.1); the moving average (window 1) reaches
    # 0.09 at step 11 where rewards jump, except in the run that went NaN before (its rewards stay 0 from 15).
    assert report["bf16_lora"]["steps_to_reward"]["per_seed"] == [11, 11]
    assert aqn["steps_to_reward"]["per_seed"] == [11]
    assert report["base-bf16"]["greedy"]["accuracy"] == 0.003 and report["nvfp4_lora"] == {"runs": []}
    assert (tmp_path / "arms.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "base bf16" in printed and "0.50% ± 6.35%" in printed


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
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_each_run_is_qerl_train_then_eval_gsm8k(tmp_path):
    args = _args(tmp_path)
    task = arms_runs.train_task(args, "nvfp4_lora_aqn-seed2", "ckpt/nvfp4", True, 1e-4, 2, 80, save_every=27)
    train = task.command
    assert train[1:3] == ["-m", "qerl.train"] and train[-1] == "--x"
    assert task.log == tmp_path / "nvfp4_lora_aqn-seed2" / "log.txt"
    flags = dict(zip(train[3::2], train[4::2], strict=False))
    assert Path(flags["--config"]) == arms_runs.REPO / "configs" / "qwen2.5_coder_1.5b_gsm8k_hash.yaml"
    arm = (flags["--aqn"], flags["--learning-rate"], flags["--seed"], flags["--max-steps"])
    assert arm == ("true", "0.0001", "2", "80")
    assert (flags["--save-strategy"], flags["--save-steps"]) == ("steps", "27")
    evaluate = arms_runs.eval_task(args, "ckpt/nvfp4", tmp_path / "run", "greedy", tmp_path / "run" / "e.jsonl", task)
    command = evaluate.command
    assert command[1:3] == ["-m", "eval.gsm8k"] and command[-2:] == ["--adapter", str(tmp_path / "run")]
    assert command[command.index("--format") + 1] == "gsm8k_hash" and evaluate.after is task and evaluate.optional
    # A run whose adapter is saved, or an eval whose output exists, has nothing left to do.
    (tmp_path / "nvfp4_lora_aqn-seed2").mkdir()
    (tmp_path / "nvfp4_lora_aqn-seed2" / "adapter_config.json").write_text("{}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "e.jsonl").write_text("{}")
    assert arms_runs.train_task(args, "nvfp4_lora_aqn-seed2", "b", True, 1e-4, 2, 80).command is None
    assert arms_runs.eval_task(args, "b", None, "greedy", tmp_path / "run" / "e.jsonl", None).command is None
    with pytest.raises(SystemExit, match="no recipe known for other-model"):
        arms_runs.recipe_for("other-model")


def _task(tmp_path, name, code="pass", after=None, optional=False):
    """A task that runs `code` in Python and records the GPU it was given."""
    record = f"open({str(tmp_path / name)!r}, 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', '-'))"
    script = f"import os; {record}; {code}"
    return arms_runs.Task(name, [sys.executable, "-c", script], tmp_path / "logs" / f"{name}.txt", after, optional)


def test_tasks_run_on_gpu_slots_after_what_they_need(tmp_path):
    train_a, train_b = _task(tmp_path, "train_a"), _task(tmp_path, "train_b", "raise SystemExit(3)")
    evals = [
        _task(tmp_path, "eval_a", after=train_a, optional=True),
        _task(tmp_path, "eval_b", after=train_b, optional=True),
    ]
    late = _task(tmp_path, "late", optional=True)
    with pytest.raises(SystemExit, match=r"failed: train_b \(.*train_b.txt\)"):
        arms_runs.run_tasks([train_a, train_b, *evals], gpus=2, per_gpu=1)
    assert [t.state for t in (train_a, train_b, *evals)] == ["done", "failed", "done", "skipped"]
    assert {(tmp_path / "train_a").read_text(), (tmp_path / "train_b").read_text()} == {"0", "1"}  # one GPU each
    assert not (tmp_path / "eval_b").exists() and "exit code 3" in (tmp_path / "logs" / "train_b.txt").read_text()
    arms_runs.run_tasks([late], gpus=1, per_gpu=1, finish_by=time.time() - 1)  # an evaluation past the deadline
    assert late.state == "skipped" and not (tmp_path / "late").exists()


def test_steps_fit_the_deadline_at_the_sweeps_pace(tmp_path):
    record = {"seconds_per_step": {"a": 4.0, "b": 5.0, "c": None}}
    args = _args(tmp_path, finish_by=time.time() + 60 + 240 + 1102)
    assert arms.planned_steps(args, record) == 200  # 1102 s at the slowest run's 5 s with the 10% margin
    with pytest.raises(SystemExit, match="only 0 steps"):
        arms.planned_steps(_args(tmp_path, finish_by=time.time() + 300), record)
    _run(tmp_path / "timed", [0.1] * 6, step_time=3.0)
    assert arms_runs.seconds_per_step(tmp_path / "timed") == 3.0


@pytest.mark.slow
def test_sweep_train_report_on_the_tiny_model(checkpoints, tmp_path, capsys):
    """The road the GPU experiment takes, on CPU: the 1.5B recipe with its rollouts and batches shrunk (BF16, its
    learning rates), two arms, sweep -> train (first seed's checkpoint evaluated) -> report."""
    bf16, _ = checkpoints
    common = ["--model", bf16, "--recipe", str(arms_runs.RECIPES["qwen2.5-coder-1.5b-instruct"]), "--checkpoint-dir",
              str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--train-data", str(DATA / "train_sample.jsonl"),
              "--test-data", str(DATA / "test_sample.jsonl"), "--per-gpu", "2", "--eval-limit", "2", "--eval-tokens",
              "4", "--protocols", "greedy"]  # fmt: skip
    shrink = ["--train-flags", "--max-completion-length", "6", "--max-prompt-length", "4096",
              "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "1", "--num-generations", "4",
              "--use-cpu", "true"]  # fmt: skip
    arms.main(
        [
            "sweep",
            *common,
            "--sweep-arms",
            "nvfp4_lora",
            "--lrs",
            "1e-5,1e-4",
            "--sweep-seeds",
            "100",
            "--steps",
            "2",
            *shrink,
        ]
    )
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert set(sweep["chosen_lr"]) == set(arms_runs.ARMS) and sweep["chosen_lr"]["bf16_lora"] is None
    assert sweep["chosen_lr"]["nvfp4_lora_aqn"] == sweep["chosen_lr"]["nvfp4_lora"] in (1e-5, 1e-4)
    arms.main(
        [
            "train",
            *common,
            "--arms",
            "nvfp4_lora,nvfp4_lora_aqn",
            "--seeds",
            "0",
            "--steps",
            "3",
            "--checkpoints",
            "1",
            *shrink,
        ]
    )
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    for arm in ("nvfp4_lora", "nvfp4_lora_aqn"):
        assert report[arm]["steps"] == [3] and report[arm]["greedy"]["per_seed"][0]["accuracy"][0] in (0.0, 0.5, 1.0)
        assert [step for step, _ in report[arm]["accuracy_curve"]] == [0, 2, 3]
    assert report["base-nvfp4"]["greedy"]["examples"] == 2
    assert "nvfp4_lora_aqn" in capsys.readouterr().out
