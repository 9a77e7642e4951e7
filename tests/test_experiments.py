"""experiments/arms.py's report: per-arm reward, non-finite gradient steps and accuracies, from run folders shaped
as the GPU runs leave them (metrics.jsonl lines with TRL's keys, eval.gsm8k summaries); the commands it runs."""

import argparse
import json
import math

import pytest

from experiments import arms


def _run(folder, rewards, nan_from=None, accuracy=0.01):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, reward in enumerate(rewards, 1):
            broken = nan_from is not None and step >= nan_from
            row = {"step": step, "loss": 0.0, "reward": 0.0 if broken else reward,
                   "grad_norm": math.nan if broken else 0.3, "entropy": None if broken and step > nan_from else 0.7}
            f.write(json.dumps(row) + "\n")  # NaN as JSON's NaN, as json.dumps writes TRL's log lines
    for protocol in arms.PROTOCOLS:
        summary = {"accuracy": accuracy, "accuracy_ci95": [0.0, 0.02], "accuracy_flexible": 2 * accuracy,
                   "accuracy_flexible_ci95": [0.0, 0.03]}  # fmt: skip
        (folder / f"eval-{protocol}.jsonl").write_text(json.dumps(summary) + "\n")


def test_report_tables_nonfinite_steps_accuracies_and_draws(tmp_path, capsys):
    out = tmp_path / "arms"
    _run(out / "bf16_lora-seed0", [0.05] * 10 + [0.2] * 10)
    _run(out / "bf16_lora-seed1", [0.05] * 10 + [0.2] * 10, nan_from=15, accuracy=0.0)
    _run(out / "nvfp4_lora_aqn-seed0", [0.07] * 20, accuracy=0.02)
    _run(out / "base-bf16", [], accuracy=0.003)
    arms.main(["report", "--out", str(out), "--png", str(tmp_path / "arms.png")])
    report = json.loads((out / "report.json").read_text())
    bf16 = report["bf16_lora"]
    assert bf16["first_nonfinite_grad_step"] == [None, 15]
    assert bf16["reward_first_tenth"] == [0.05, 0.0] and bf16["reward_last_tenth"][0] == 0.1  # (0.2 + 0.0) / 2
    assert bf16["greedy"]["accuracy"] == [0.005, pytest.approx(0.01 / math.sqrt(2))]  # mean, sd over seeds
    assert report["nvfp4_lora_aqn"]["reference"]["accuracy_flexible"][0] == 0.04
    assert report["base-bf16"]["greedy"]["accuracy"] == 0.003 and report["nvfp4_lora"] == {"runs": []}
    assert (tmp_path / "arms.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "-,15" in printed and "base bf16" in printed


def test_each_run_is_qerl_train_then_eval_gsm8k(tmp_path):
    args = argparse.Namespace(
        train_data="train.jsonl", test_data="test.jsonl", format="gsm8k_lenient", temperature=0.7, train_flags=["--x"],
        eval_tokens=512, eval_kv_gib=4.0, eval_limit=None,
    )  # fmt: skip
    train = arms.train_command(args, "ckpt/nvfp4", True, 1e-4, 2, 80, tmp_path / "run")
    assert train[1:3] == ["-m", "qerl.train"] and train[-1] == "--x"
    flags = dict(zip(train[3::2], train[4::2], strict=False))
    assert (flags["--aqn"], flags["--learning-rate"], flags["--seed"], flags["--temperature"]) == ("true", "0.0001",
                                                                                                    "2", "0.7")
    evaluate = arms.eval_command(args, "ckpt/nvfp4", tmp_path / "run", "greedy", tmp_path / "e.jsonl")
    assert evaluate[1:3] == ["-m", "eval.gsm8k"] and evaluate[-2:] == ["--adapter", str(tmp_path / "run")]
    assert evaluate[evaluate.index("--format") + 1] == "gsm8k_hash"
