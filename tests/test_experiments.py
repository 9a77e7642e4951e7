"""experiments.arms: the run records kept as data (arms_results.py: what a record keeps, the loader's errors); the
report read from them (arms_report.py: the experiment pooled, per-arm measures with intervals, the fixed comparisons
against scipy's Welch test, the card/packing effect); the commands each run is and the scheduler that puts runs on
GPU slots before a deadline (arms_runs.py); the step count fitted to a deadline (arms.py); and the whole sweep ->
train -> report road on the tiny model, the 1.5B recipe shrunk, its records written once and never run again."""

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest
from scipy import stats

from benchmarks import launch
from experiments import arms, arms_results, arms_runs

DATA = Path(__file__).parent / "data" / "gsm8k"


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


def _record(results, arm, seed, accuracy, rewards=(0.1,) * 10 + (0.5,) * 10, sharing="mps", steps=20, **broken):
    """A committed record of a finished run, made from its folder as the runner makes it."""
    folder = results.parent / "runs" / f"{arm}-seed{seed}-{sharing}-{steps}"
    _run(folder, list(rewards[:steps]), accuracy=accuracy, **broken)
    setting = {"arm": arm, "seed": seed, "steps": steps, "sharing": sharing, "model": "m", "format": "gsm8k_hash",
               "runs_per_gpu": 1 if sharing == "alone" else 5, "card": "NVIDIA H100"}  # fmt: skip
    record = arms_results.run_record(folder, setting, arms_runs.PROTOCOLS)
    record["name"] = f"{arm}-seed{seed}" + ("" if sharing == "mps" else f"-{sharing}") + ("" if steps == 20 else "-x")
    arms_results.write_record(arms_results.record_path(results, record["name"]), record)
    return record


def test_a_record_keeps_the_curve_and_scores_not_the_samples(tmp_path):
    folder = tmp_path / "run"
    _run(folder, [0.2, 0.4, 0.6], nan_from=3, protocols=("greedy",))
    (folder / "eval-greedy-step2.jsonl").write_text(json.dumps({"accuracy": 0.25}) + "\n")
    record = arms_results.run_record(folder, {"arm": "bf16_lora", "seed": 4, "sharing": "mps"}, ("greedy",))
    arms_results.write_record(tmp_path / "r" / "bf16_lora-seed4.json", record)
    text = (tmp_path / "r" / "bf16_lora-seed4.json").read_text()
    assert "#### 3" not in text and "/tmp/x" not in text and "NaN" not in text  # no samples, no paths; NaN -> null
    (loaded,) = arms_results.load_records(tmp_path / "r")
    assert loaded["evals"]["greedy"] == {"protocol": "greedy", "examples": 100, "accuracy": 0.01,
                                         "accuracy_ci95": [0.0, 0.02], "accuracy_flexible": 0.02,
                                         "accuracy_flexible_ci95": [0.0, 0.03]}  # fmt: skip
    assert loaded["checkpoint_greedy_accuracy"] == {"2": 0.25} and loaded["name"] == "run"
    rows = arms_results.curve_rows(loaded)
    assert [r["reward"] for r in rows] == [0.2, 0.4, 0.0] and rows[2]["grad_norm"] is None
    kept = {"step", "loss", "reward", "step_time", "grad_norm", "entropy", "completions/clipped_ratio"}
    assert rows[2]["entropy"] == 0.7 and set(rows[0]) == kept
    assert len(text) < 4000  # a few KB a run: committed as data
    with pytest.raises(FileNotFoundError, match="eval-reference.jsonl"):
        arms_results.run_record(folder, {"arm": "bf16_lora"}, ("greedy", "reference"))


def test_the_results_loader_names_the_bad_file(tmp_path):
    (tmp_path / "a.json").write_text("{")
    with pytest.raises(SystemExit, match=r"a.json: not JSON"):
        arms_results.load_records(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"name": "a", "arm": "bf16_lora", "evals": {}}))
    with pytest.raises(SystemExit, match="a.json: a trained run's record without its training curve"):
        arms_results.load_records(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"name": "a", "evals": {}}))
    with pytest.raises(SystemExit, match="a.json: not a run record .no arm."):
        arms_results.load_records(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"name": "a", "arm": None, "evals": {}, "sharing": "gpu"}))
    with pytest.raises(SystemExit, match="a.json: sharing 'gpu'"):
        arms_results.load_records(tmp_path)
    assert arms_results.load_records(tmp_path / "none") == []


def test_report_pools_one_experiment_and_compares_the_arms(tmp_path, capsys):
    results = tmp_path / "results"
    for seed, (bf16, nvfp4, aqn) in enumerate([(0.60, 0.58, 0.61), (0.62, 0.57, 0.60), (0.64, 0.59, 0.62)]):
        _record(results, "bf16_lora", seed, bf16)
        _record(results, "nvfp4_lora", seed, nvfp4, rewards=(0.1,) * 10 + (0.3,) * 10)
        _record(results, "nvfp4_lora_aqn", seed, aqn)
    for seed, accuracy in enumerate([0.55, 0.65, 0.60]):
        _record(results, "bf16_lora", seed, accuracy, sharing="alone")
    _record(results, "bf16_lora", 7, 0.99, steps=10)  # another experiment: left out
    base = arms_results.run_record(
        _base(tmp_path / "runs" / "base-bf16"), {"arm": None, "precision": "bf16"}, ("greedy",)
    )
    arms_results.write_record(results / "base-bf16.json", base)
    # One seed: its completions all truncated from step 15 on, its last step's gradient not finite.
    _record(results, "bf16_lora_aqn", 0, 0.5, nan_from=20, truncated_from=15)
    args = argparse.Namespace(results=results, out=tmp_path / "out", png=tmp_path / "out" / "arms.png")
    result = arms.report(args)
    assert (result["steps"], result["sharing"]) == (20, "mps")
    assert result["left_out"] == ["bf16_lora-seed0-alone", "bf16_lora-seed1-alone", "bf16_lora-seed2-alone",
                                  "bf16_lora-seed7-x"]  # fmt: skip
    bf16 = result["arms"]["bf16_lora"]
    assert bf16["seeds"] == [0, 1, 2] and bf16["greedy"]["mean"] == pytest.approx(0.62)
    assert bf16["greedy"]["ci95"] == pytest.approx(stats.t.ppf(0.975, 2) * 0.02 / math.sqrt(3))
    assert bf16["reward_last_tenth"]["mean"] == pytest.approx(0.5)
    broken = result["arms"]["bf16_lora_aqn"]
    assert broken["nonfinite_runs"] == ["bf16_lora_aqn-seed0"] and broken["greedy"]["ci95"] == 0.0
    assert broken["stuck_at_length_cap"] == ["bf16_lora_aqn-seed0"] and bf16["stuck_at_length_cap"] == []
    assert result["runs"]["bf16_lora_aqn-seed0"]["first_nonfinite_grad_step"] == 20
    # The level is 90% of the lowest arm's last-tenth reward (the broken run's (0.5 + 0) / 2): every run's average
    # reaches 0.225 at step 11 (window 1 at 20 steps), where its rewards jump.
    assert result["reward_level"] == {"reward": pytest.approx(0.225), "window": 1}
    assert bf16["steps_to_reward"]["mean"] == 11 and bf16["not_reaching_reward_level"] == 0
    aqn_in_bf16 = [c for c in result["comparisons"] if c["a"] == "bf16_lora_aqn"]
    assert aqn_in_bf16 and all("difference" not in c for c in aqn_in_bf16)  # one seed: too few runs
    first = result["comparisons"][0]
    assert (first["a"], first["b"], first["measure"]) == ("nvfp4_lora_aqn", "bf16_lora", "greedy")
    reference = stats.ttest_ind([0.61, 0.60, 0.62], [0.60, 0.62, 0.64], equal_var=False)
    assert first["difference"] == pytest.approx(-0.01) and first["p"] == pytest.approx(reference.pvalue)
    entropy = next(c for c in result["comparisons"] if c["measure"] == "entropy_first_tenth")
    assert "difference" not in entropy  # equal entropies everywhere: no interval to form
    (effect,) = result["settings"]
    assert effect["arm"] == "bf16_lora" and [w["sharing"] for w in effect["ways"]] == ["mps", "alone"]
    alone = effect["ways"][1]
    assert alone["minus_first"]["difference"] == pytest.approx(-0.02)
    assert alone["variance_ratio_to_first"]["ratio"] == pytest.approx(0.05**2 / 0.02**2)
    assert result["bases"]["bf16"]["greedy"]["accuracy"] == 0.3
    assert (tmp_path / "out" / "arms.png").stat().st_size > 0
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["arms"]["nvfp4_lora"]["greedy"]["n"] == 3
    printed = capsys.readouterr().out
    assert "| BF16 + LoRA | 3 | 62.0 ± 5.0 | 2.0 |" in printed and "| base BF16, no training | - | 30.0 |" in printed
    assert "| NVFP4 + AQN vs BF16 LoRA (QeRL against 16-bit LoRA) | greedy | -1.0 |" in printed
    assert "| AQN within BF16 | greedy | - | - | - | - | too few runs |" in printed
    assert "| BF16 + LoRA + AQN | 1 | 50.0 ± 0.0 | 0.0 |" in printed and "| 1 of 1 |" in printed
    assert (tmp_path / "out" / "report.md").read_text() in printed


def _base(folder):
    folder.mkdir(parents=True)
    summary = {"protocol": "greedy", "accuracy": 0.3, "accuracy_ci95": [0.27, 0.33]}
    (folder / "eval-greedy.jsonl").write_text(json.dumps(summary) + "\n")
    return folder


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
    assert Path(flags["--config"]) == launch.REPO / "configs" / "qwen2.5_coder_1.5b_gsm8k_hash.yaml"
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
    common = ["--model", bf16, "--recipe", str(launch.RECIPES["qwen2.5-coder-1.5b-instruct"]), "--checkpoint-dir",
              str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--train-data", str(DATA / "train_sample.jsonl"),
              "--test-data", str(DATA / "test_sample.jsonl"), "--per-gpu", "2", "--eval-limit", "2", "--eval-tokens",
              "4", "--protocols", "greedy", "--results", str(tmp_path / "results")]  # fmt: skip
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
