"""experiments.layer_sensitivity: each group of Linears rounded alone and ranked, then the model rounded but for the
worst groups; the in-memory rounding is the quantizer's (the k = 0 model is the NVFP4 checkpoint's, and the --ignore
list it prints writes a checkpoint with the same KL), on the tiny checkpoints in BF16 as a GPU run computes."""

import json

import pytest
import torch

from benchmarks.launch import REPO
from benchmarks.quant_quality import read_gsm8k, solution_sequences, token_logprobs
from experiments import layer_sensitivity
from qerl import base_model
from qerl.errors import UsageError
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint

TRAIN = str(REPO / "tests" / "data" / "gsm8k" / "train_sample.jsonl")


def _kl_of_checkpoint(bf16_dir, folder, solutions):
    """Mean KL(BF16 || the checkpoint in `folder`) per answer token over the solutions, as the tool scores a model."""
    tokenizer = base_model.load_tokenizer(bf16_dir)
    bf16 = base_model.load_base_model(bf16_dir, "bf16", torch.bfloat16, "cpu").eval()
    nvfp4 = base_model.load_base_model(folder, "nvfp4", torch.bfloat16, "cpu").eval()
    sequences = solution_sequences(tokenizer, read_gsm8k(TRAIN, solutions))
    with torch.no_grad():
        reference = token_logprobs(bf16, sequences, tokenizer.pad_token_id, 4)
        values = layer_sensitivity.kl_per_solution(nvfp4, sequences, reference, tokenizer.pad_token_id, 4)
    return sum(values) / len(values)


def test_groups_ranked_and_the_worst_kept_in_bf16_as_the_quantizer_writes_them(checkpoints, tmp_path, monkeypatch):
    bf16_dir, nvfp4_dir = checkpoints
    monkeypatch.setattr(layer_sensitivity, "RESULTS", tmp_path / "results")
    result = layer_sensitivity.main(
        ["--bf16", bf16_dir, "--data", TRAIN, "--solutions", "4", "--keep", "0,1,8", "--batch-size", "4"]
        + ["--name", "tiny"]
    )
    groups = result["groups"]
    assert [len(g["modules"]) for g in groups].count(3) == 2  # q/k/v of each of the tiny model's two layers
    assert len(groups) == 8 and all(g["kl"][0] > 0 for g in groups)
    assert [g["kl"][0] for g in groups] == sorted((g["kl"][0] for g in groups), reverse=True)
    keep = {row["k"]: row for row in result["keep"]}
    assert keep[8]["kl"][0] == 0.0 and keep[8]["bf16_extra_bytes"] == sum(g["bf16_extra_bytes"] for g in groups)
    assert keep[1]["ignore"] == ["lm_head", *groups[0]["modules"]]
    # k = 0 is the base every 4-bit run trains on: the quantizer's checkpoint scores the same KL.
    assert keep[0]["kl"][0] == pytest.approx(_kl_of_checkpoint(bf16_dir, nvfp4_dir, 4), rel=1e-3)
    # k = 1 as qerl.quantize writes it from the printed --ignore list.
    kept = quantize_checkpoint(bf16_dir, tmp_path / "kept1", ignore=keep[1]["ignore"])
    assert keep[1]["kl"][0] == pytest.approx(_kl_of_checkpoint(bf16_dir, kept, 4), rel=1e-3)
    record = json.loads((tmp_path / "results" / "tiny.json").read_text())
    assert record["card"] == "cpu" and record["keep"][1]["ignore"] == keep[1]["ignore"]
    assert "--ignore lm_head " in (tmp_path / "results" / "tiny.md").read_text()


def test_the_model_comes_back_bit_for_bit(checkpoints):
    bf16_dir, _ = checkpoints
    tokenizer = base_model.load_tokenizer(bf16_dir)
    model = base_model.load_base_model(bf16_dir, "bf16", torch.float32, "cpu").eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    layer_sensitivity.measure(model, tokenizer, read_gsm8k(TRAIN, 2), [0, 3], 2, progress=False)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_more_groups_kept_than_the_model_has_is_one_line(checkpoints):
    with pytest.raises(UsageError, match="--keep 9: the model has 8 groups of Linears"):
        layer_sensitivity.main(["--bf16", checkpoints[0], "--data", TRAIN, "--keep", "0,9"])
    with pytest.raises(UsageError, match="--keep"):
        layer_sensitivity.main(["--bf16", checkpoints[0], "--keep", "-1"])
