"""experiments.arms: the step count fitted to a deadline, and the whole sweep -> train -> report road on the tiny
model, the 1.5B recipe shrunk, its records written once and never run again."""

import json
import shutil
import time

import pytest
from arms_folders import _args, _run

from benchmarks import launch
from experiments import arms, arms_results, arms_runs

DATA = launch.REPO / "tests" / "data" / "gsm8k"


def test_steps_fit_the_deadline_at_the_sweeps_pace(tmp_path):
    record = {"seconds_per_step": {"a": 4.0, "b": 5.0, "c": None}}
    args = _args(tmp_path, finish_by=time.time() + 60 + 240 + 1102)
    assert arms.planned_steps(args, record) == 200  # 1102 s at the slowest run's 5 s with the 10% margin
    with pytest.raises(SystemExit, match="only 0 steps"):
        arms.planned_steps(_args(tmp_path, finish_by=time.time() + 300), record)
    _run(tmp_path / "timed", [0.1] * 6, step_time=3.0)
    assert arms_results.seconds_per_step(tmp_path / "timed") == 3.0


@pytest.mark.slow
def test_the_gptq_arm_trains_on_a_gptq_base_made_once(checkpoints, tmp_path, monkeypatch):
    """nvfp4_gptq_lora: `train` makes the GPTQ-rounded NVFP4 base beside the others (calibrated on the train file,
    as qerl.quantize --gptq-calibration), once, and trains and evaluates on it; the paper's arms do not make it."""
    from qerl.nvfp4 import checkpoint

    bf16, _ = checkpoints
    tasks = []
    monkeypatch.setattr(arms, "run_tasks", lambda found, *a, **k: tasks.extend(found))
    monkeypatch.setattr(arms, "report", lambda args: None)
    argv = ["train", "--model", bf16, "--recipe", str(launch.RECIPES["qwen2.5-coder-1.5b-instruct"]),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
            "--train-data", str(DATA / "train_sample.jsonl"), "--results", str(tmp_path / "results"), "--seeds", "0",
            "--steps", "2", "--lr", "1e-4", "--protocols", "greedy"]  # fmt: skip
    (tmp_path / "out").mkdir()
    arms.main([*argv, "--arms", "nvfp4_lora"])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["bf16-nvfp4"]
    arms.main([*argv, "--arms", "nvfp4_gptq_lora,bf16_lora"])
    gptq = tmp_path / "ckpt" / "bf16-nvfp4-gptq"
    assert checkpoint.is_nvfp4_checkpoint(str(gptq))
    made = gptq.stat().st_mtime_ns
    training = next(t for t in tasks if t.name.startswith("nvfp4_gptq_lora-seed0-shared train"))
    assert training.command[training.command.index("--model-name") + 1] == str(gptq)
    evaluation = next(t for t in tasks if t.after is training)
    assert evaluation.command[evaluation.command.index("--model") + 1] == str(gptq)
    arms.main([*argv, "--arms", "nvfp4_gptq_lora"])
    assert gptq.stat().st_mtime_ns == made  # made once


@pytest.mark.slow
def test_sweep_train_report_on_the_tiny_model(checkpoints, tmp_path, capsys):
    """The road the GPU experiment takes, on CPU: the 1.5B recipe with its rollouts and batches shrunk (BF16, its
    learning rates), two arms, sweep -> train (first seed's checkpoint evaluated) -> report."""
    bf16, _ = checkpoints
    common = ["--model", bf16, "--recipe", str(launch.RECIPES["qwen2.5-coder-1.5b-instruct"]), "--checkpoint-dir",
              str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--train-data", str(DATA / "train_sample.jsonl"),
              "--test-data", str(DATA / "test_sample.jsonl"), "--per-gpu", "2", "--eval-limit", "2", "--eval-tokens",
              "4", "--protocols", "greedy", "--results", str(tmp_path / "results")]  # fmt: skip
    shrink = ["--train-flags", "--max-completion-length", "6", "--soft-overlong-cache", "2", "--max-prompt-length",
              "4096", "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "1", "--num-generations",
              "4", "--use-cpu", "true"]  # fmt: skip
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
    train = ["train", *common, "--arms", "nvfp4_lora,nvfp4_lora_aqn", "--seeds", "0", "--steps", "3",
             "--checkpoints", "1", "--bases", *shrink]  # fmt: skip
    arms.main(train)
    results = tmp_path / "results"
    names = sorted(p.stem for p in results.glob("*.json"))
    assert names == ["base-bf16", "base-nvfp4", "nvfp4_lora-seed0-shared", "nvfp4_lora_aqn-seed0-shared"]
    record = json.loads((results / "nvfp4_lora_aqn-seed0-shared.json").read_text())
    assert (record["arm"], record["aqn"], record["seed"], record["steps"], record["sharing"]) == (
        "nvfp4_lora_aqn",
        True,
        0,
        3,
        "shared",
    )
    assert record["card"] == "cpu" and record["curve"]["step"] == [1, 2, 3] and record["train_seconds"] > 0
    assert record["evals"]["greedy"]["examples"] == 2 and list(record["checkpoint_greedy_accuracy"]) == ["2"]
    assert record["recipe"] == "configs/qwen2.5_coder_1.5b_gsm8k_hash.yaml" and len(record["commit"]) >= 7
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["arms"]["nvfp4_lora"]["greedy"]["n"] == 1 and report["bases"]["nvfp4"]["greedy"]["examples"] == 2
    assert "NVFP4 + LoRA + AQN" in capsys.readouterr().out
    # Recorded runs are not run again, even with their folders gone (a later lease on another machine).
    for folder in (tmp_path / "out").glob("nvfp4_lora*"):
        shutil.rmtree(folder)
    arms.main(train)
    assert not (tmp_path / "out" / "nvfp4_lora-seed0-shared").exists()
    assert "2 run(s) already recorded" in capsys.readouterr().out
