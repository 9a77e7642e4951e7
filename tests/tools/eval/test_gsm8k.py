"""eval.gsm8k (eval/gsm8k.py): whole-answer scoring on the real gold solutions, and bad input refused in one line
before anything loads (its TRIALS; the trials of every program: tests/helpers/bad_input.py)."""

import json

import pytest
from bad_input import E, check_trial, trial_ids

from benchmarks.launch import SHARED_GSM8K
from eval import gsm8k
from qerl.rewards import gsm8k_gold

GSM8K_TEST = SHARED_GSM8K / "test.jsonl"


@pytest.mark.skipif(not GSM8K_TEST.is_file(), reason=f"GSM8K data not found at {GSM8K_TEST}")
def test_gold_answers_score_and_near_misses_do_not():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines()]
    for row in rows:
        gold = gsm8k_gold(row["answer"])
        reasoning = row["answer"].split("####")[0]
        assert gsm8k.score(f"<think>{reasoning}</think> <answer>{gold}</answer>", gold) == {
            "correct": True,
            "flexible": True,
        }
        assert gsm8k.score(f"{reasoning} So the answer is {gold}.", gold) == {"correct": False, "flexible": True}
        wrong = str(int(float(gold)) + 10)  # same first character as the gold for most answers
        assert gsm8k.score(f"<answer>{wrong}</answer>", gold) == {"correct": False, "flexible": False}
        # a wrong tagged answer is wrong even when the right number appears earlier in the text
        assert not gsm8k.score(f"{gold} ... <answer>{wrong}</answer>", gold)["flexible"]


TRIALS = [
    # prog, argv, fragment(s) of the one line
    ("eval.gsm8k", [*E, "--limit", "0"], "--limit: must be an integer >= 1, got 0"),
    ("eval.gsm8k", [*E, "--limit", "-3"], "--limit: must be an integer >= 1, got -3"),
    ("eval.gsm8k", [*E, "--adapter", "no_adapter"], "no_adapter: no adapter_config.json"),
    ("eval.gsm8k", [*E, "--adapter", "nope"], "--adapter nope: no such folder"),
    (
        "eval.gsm8k",
        [*E, "--adapter", "other_base"],
        "--adapter other_base does not fit --model ck/nvfp4: "
        "model.layers.0.mlp.down_proj is [64, 128] (out, in) in the model, [32, 64] in the adapter",
    ),
    ("eval.gsm8k", [*E, "--model", "gguf_folder"], "SmolLM2-135M-Instruct.Q4_1.gguf is a GGUF file"),
    ("eval.gsm8k", [*E, "--seed", "-1"], "--seed: must be an integer in [0, 4294967295], got -1"),
    ("eval.gsm8k", [*E, "--batch-size", "0"], "--batch-size: must be an integer >= 1, got 0"),
    ("eval.gsm8k", [*E, "--data", "gsm9k"], "--data gsm9k: unknown dataset (did you mean gsm8k?)"),
    ("eval.gsm8k", [*E, "--data", "missing.jsonl"], "--data missing.jsonl: no such file"),
    ("eval.gsm8k", [*E, "--data", "broken.jsonl"], "broken.jsonl, line 2: not JSON"),
    ("eval.gsm8k", [*E, "--data", "nocolumn.jsonl"], "column(s) answer"),
    ("eval.gsm8k", [*E, "--device", "cuda:3"], "--device 'cuda:3'"),
    ("eval.gsm8k", [*E, "--device", "tpu-ish"], "not a device name"),
    ("eval.gsm8k", [*E, "--model", "./nope"], "--model ./nope: no such folder"),
    ("eval.gsm8k", [*E, "--model", "truncated"], "truncated or corrupt"),
    ("eval.gsm8k", [*E, "--load", "bf16"], "is an NVFP4 checkpoint"),
    ("eval.gsm8k", [*E, "--protocol", "greedyy"], "invalid choice: 'greedyy'"),
    ("eval.gsm8k", [*E, "--out", "ck"], "--out ck: is a folder"),
    ("eval.gsm8k", [*E, "--modle", "x"], "unknown flag --modle (did you mean --model?)"),
]


@pytest.mark.parametrize("trial", TRIALS, ids=trial_ids(TRIALS))
def test_bad_input_is_one_line_and_changes_nothing(world, monkeypatch, capsys, trial):
    check_trial(world, monkeypatch, capsys, trial)
