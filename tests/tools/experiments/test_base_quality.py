"""experiments.base_quality: NVFP4 bases of one model against its BF16 base, paired over the same GSM8K train
solutions, as a record with its tables (the tiny checkpoints, float32 on the CPU)."""

import json

import pytest
import torch

from benchmarks.launch import REPO
from experiments import base_quality
from qerl.errors import UsageError
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint

TRAIN = str(REPO / "tests" / "data" / "gsm8k" / "train_sample.jsonl")


def test_bases_side_by_side_paired_over_the_same_solutions(checkpoints, tmp_path, monkeypatch):
    bf16_dir, nvfp4_dir = checkpoints
    float32_dir = quantize_checkpoint(bf16_dir, tmp_path / "float32", dtype=torch.float32)  # another rounding
    monkeypatch.setattr(base_quality, "RESULTS", tmp_path / "results")
    flags = ["--bf16", bf16_dir, "--data", TRAIN, "--solutions", "5", "--prompts", "2", "--max-new-tokens", "6"]
    bases = ["--base", f"rtn={nvfp4_dir}", "--base", f"again={nvfp4_dir}", "--base", f"float32={float32_dir}"]
    result = base_quality.main([*flags, *bases, "--dtype", "float32", "--name", "tiny"])
    assert list(result["bases"]) == ["rtn", "again", "float32"] and list(result["paired"]) == ["again", "float32"]
    assert result["paired"]["again"]["kl"] == (0.0, 0.0)  # the same base: every sequence's difference is 0
    rtn = result["bases"]["rtn"]
    assert len(rtn["per_sequence"]["kl"]) == 5 and rtn["kl"] > 0
    assert list(result["sampled"]) == ["bf16", "rtn", "again", "float32"]
    record = json.loads((tmp_path / "results" / "tiny.json").read_text())
    assert record["paired"]["float32"]["kl"] == list(result["paired"]["float32"]["kl"])
    assert record["card"] == "cpu" and record["command"].startswith("python -m experiments.base_quality --bf16")
    text = (tmp_path / "results" / "tiny.md").read_text()
    assert "| rtn |" in text and "float32 - rtn, paired: KL" in text and "| bf16 |" in text


def test_a_base_without_its_name_or_folder_is_one_line(checkpoints):
    with pytest.raises(UsageError, match="--base: expected NAME=FOLDER, got 'nofolder'"):
        base_quality.main(["--bf16", checkpoints[0], "--base", "nofolder"])
    with pytest.raises(UsageError, match="--base ./nowhere: no such folder"):
        base_quality.main(["--bf16", checkpoints[0], "--base", "rtn=./nowhere"])
