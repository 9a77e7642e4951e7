"""experiments.arms_runs: the commands each run is (qerl.train, then eval.gsm8k), and the scheduler that puts runs on
GPU slots after what they need and before a deadline."""

import sys
import time
from pathlib import Path

import pytest
from arms_folders import _args

from benchmarks import launch
from experiments import arms_runs


def test_each_run_is_qerl_train_then_eval_gsm8k(tmp_path):
    args = _args(tmp_path)
    task = arms_runs.train_task(args, "nvfp4_lora_aqn-seed2", "ckpt/nvfp4", True, 1e-4, 2, 80, save_every=27)
    train = task.command
    assert train[1:3] == ["-m", "qerl.train"] and train[-1] == "--x"
    assert task.log == tmp_path / "nvfp4_lora_aqn-seed2" / "log.txt"
    flags = dict(zip(train[3::2], train[4::2], strict=False))
    assert Path(flags["--config"]) == launch.REPO / "configs" / "qwen2.5_coder_1.5b_gsm8k_hash.yaml"
    arm = (flags["--aqn"], flags["--learning-rate"], flags["--seed"], flags["--max-steps"])
    assert arm == ("true", "0.0001", "2", "80")
    assert (flags["--save-strategy"], flags["--save-steps"]) == ("steps", "27")
    assert "--keep-activations" not in train  # alone on its GPU: the trainer's memory rule decides
    # runs sharing a GPU keep the recipe's checkpointing (each would see the others' memory as free); a flag given
    # to every run still wins
    shared = arms_runs.train_task(_args(tmp_path, per_gpu=6), "r", "b", True, 1e-4, 2, 80).command
    assert shared[shared.index("--keep-activations") + 1] == "false" and shared[-1] == "--x"
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
        launch.recipe_for("other-model")


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
    recorded = []
    evals[0].on_done = lambda task: recorded.append(task.gpu)
    late = _task(tmp_path, "late", optional=True)
    with pytest.raises(SystemExit, match=r"failed: train_b \(.*train_b.txt\)"):
        arms_runs.run_tasks([train_a, train_b, *evals], gpus=[2, 5], per_gpu=1, env={"EXTRA": "1"})
    assert [t.state for t in (train_a, train_b, *evals)] == ["done", "failed", "done", "skipped"]
    assert {(tmp_path / "train_a").read_text(), (tmp_path / "train_b").read_text()} == {"2", "5"}  # one GPU each
    assert not (tmp_path / "eval_b").exists() and "exit code 3" in (tmp_path / "logs" / "train_b.txt").read_text()
    assert recorded == [evals[0].gpu] and train_a.seconds > 0  # called once its command succeeded
    arms_runs.run_tasks([late], gpus=[0], per_gpu=1, finish_by=time.time() - 1)  # an evaluation past the deadline
    assert late.state == "skipped" and not (tmp_path / "late").exists()


def test_a_training_that_would_end_past_the_deadline_is_not_started(tmp_path):
    fits, too_long = _task(tmp_path, "fits"), _task(tmp_path, "too_long")
    fits.expected_seconds = arms_runs.RunPace(60).estimate  # the guess, until a run has finished
    pace = arms_runs.RunPace(60)
    pace.observe(30)
    pace.observe(600)  # the longest run seen took 10 minutes: the next is expected to as well
    too_long.expected_seconds = pace.estimate
    evaluation = _task(tmp_path, "eval", after=too_long, optional=True)
    done_before = arms_runs.Task("kept", None, tmp_path / "kept.txt", on_done=lambda _: (tmp_path / "rec").touch())
    arms_runs.run_tasks([fits, too_long, evaluation, done_before], gpus=[], per_gpu=2, finish_by=time.time() + 300)
    assert [t.state for t in (fits, too_long, evaluation, done_before)] == ["done", "skipped", "skipped", "done"]
    assert (tmp_path / "fits").read_text() == "-" and not (tmp_path / "too_long").exists()  # CPU: no GPU given
    assert (tmp_path / "rec").exists()  # output there from an earlier start: its record is still written


def test_with_the_other_base_a_run_ends_with_its_adapter_on_that_base(tmp_path):
    """--other-base: after its own evaluations, the adapter greedy on the other precision's base, into the file the
    record reads (arms_results.OTHER_BASE), rewriting the record like the others."""
    args = _args(tmp_path, protocols=("greedy", "reference"))
    trained = arms_runs.train_task(args, "bf16_lora-seed3", "ckpt/bf16", False, 3e-4, 3, 51)
    run = {"arm": "bf16_lora", "precision": "bf16", "seed": 3}
    group = arms_runs.run_group(args, "bf16_lora-seed3", "ckpt/bf16", trained, run, 0, 51, None, "ckpt/nvfp4")
    assert [t.name for t in group[1:]] == ["bf16_lora-seed3 eval-greedy", "bf16_lora-seed3 eval-reference",
                                           "bf16_lora-seed3 eval-greedy_other_base"]  # fmt: skip
    other = group[-1]
    assert other.command[other.command.index("--model") + 1] == "ckpt/nvfp4"
    assert other.command[other.command.index("--protocol") + 1] == "greedy"
    assert other.after is group[-2] and other.on_done is group[-2].on_done is not None
    assert len(arms_runs.run_group(args, "bf16_lora-seed3", "ckpt/bf16", trained, run, 0, 51, None)) == 3
