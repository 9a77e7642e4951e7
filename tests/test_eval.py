"""eval: GSM8K whole-answer scoring on the real gold solutions; runs with and without a LoRA through the rollout
engines training uses (eval/generate.py); competition-math scoring (eval/competition_math.py); the Wilson interval."""

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from eval import cli as eval_cli
from eval import competition_math, gsm8k
from eval.statistics import wilson_interval
from qerl import cli
from qerl.base_model import load_base_model
from qerl.rewards import gsm8k_gold

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


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


def _eval(module, argv, out):
    assert cli.run_cli(module.main, module.__name__, [*argv, "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return lines[0], lines[1:]


def test_runs_on_nvfp4_base_applies_the_adapter_and_is_seeded(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": f"What is {a} plus {a}?", "answer": f"{a}+{a}={2 * a}\n#### {2 * a}"}) + "\n"
            for a in (3, 11, 40)
        )
    )
    base = load_base_model(nvfp4_dir, precision="nvfp4", device="cpu")
    torch.manual_seed(0)
    adapter = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    adapter.save_pretrained(tmp_path / "adapter")

    argv = ["--model", nvfp4_dir, "--data", str(data), "--max-new-tokens", "6", "--batch-size", "2", "--device", "cpu"]
    results = {}
    for name, extra in (("base", []), ("lora", ["--adapter", str(tmp_path / "adapter")]), ("again", [])):
        summary, rows = _eval(gsm8k, [*argv, *extra], tmp_path / f"{name}.jsonl")
        assert summary["examples"] == 3 and len(rows) == 3 and summary["protocol"] == "reference"
        assert (summary["temperature"], summary["top_p"], summary["seed"]) == (0.6, 0.95, 0)
        low, high = summary["accuracy_ci95"]
        assert 0.0 <= low <= summary["accuracy"] <= high <= 1.0 and "accuracy_flexible_ci95" in summary
        assert [r["gold"] for r in rows] == ["6", "22", "80"] and all(isinstance(r["correct"], bool) for r in rows)
        results[name] = [r["completion"] for r in rows]
    assert results["base"] != results["lora"]  # the adapter reached generation
    assert results["base"] == results["again"]  # sampled, but seeded
    greedy, _ = _eval(gsm8k, [*argv, "--protocol", "greedy"], tmp_path / "greedy.jsonl")
    assert greedy["do_sample"] is False and not list(tmp_path.glob("*.partial-*"))


def test_native_backend_runs_on_the_policy_and_auto_falls_back_as_training_does(
    checkpoints, tmp_path, monkeypatch, capsys
):
    """--rollout-backend native samples with the engine training uses (here on the CPU, seeded) and greedy decodes
    what transformers' generate decodes; auto falls back where the engine refuses a model through the rule training
    uses (rollout.with_auto_fallback)."""
    from qerl import rollout

    _, nvfp4_dir = checkpoints
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a} + {a}?", "answer": f"#### {2 * a}"}) + "\n" for a in (1, 7)))
    argv = ["--model", nvfp4_dir, "--data", str(data), "--max-new-tokens", "5", "--device", "cpu"]
    runs = [_eval(gsm8k, [*argv, "--rollout-backend", "native"], tmp_path / f"native{i}.jsonl")[1] for i in range(2)]
    assert [r["completion"] for r in runs[0]] == [r["completion"] for r in runs[1]] and len(runs[0]) == 2
    greedy = {
        name: [r["completion"] for r in _eval(gsm8k, [*argv, "--protocol", "greedy", "--rollout-backend", name],
                                               tmp_path / f"greedy-{name}.jsonl")[1]]
        for name in ("native", "transformers")
    }  # fmt: skip
    assert greedy["native"] == greedy["transformers"]

    build = rollout.build_backend

    def refuse_native(name, setup):
        if name == "native":
            raise rollout.Unsupported("the native engine cannot run this model")
        return build(name, setup)

    monkeypatch.setattr(rollout, "resolve_backend", lambda name, device=None: "native")  # as on a GPU
    monkeypatch.setattr(rollout, "build_backend", refuse_native)
    _, rows = _eval(gsm8k, [*argv, "--protocol", "greedy"], tmp_path / "auto.jsonl")
    assert [r["completion"] for r in rows] == greedy["transformers"]
    assert "eval: the native engine cannot run this model; using transformers" in capsys.readouterr().out


def test_math_eval_on_a_local_file_scores_boxed_answers(checkpoints, tmp_path, monkeypatch):
    """eval.competition_math reads problem/answer rows and scores through qerl.rewards' math-verify reward."""
    _, nvfp4_dir = checkpoints
    data = tmp_path / "math.jsonl"
    data.write_text(
        "".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in (("1+1?", "2"), ("x?", "\\frac{1}{2}")))
    )
    canned = ["<think>easy</think> <answer>\\boxed{2}</answer>", "so $\\boxed{0.5}$"]
    monkeypatch.setattr(eval_cli, "generate", lambda spec, prompts, sampling: canned[: len(prompts)])
    argv = ["--model", nvfp4_dir, "--data", str(data), "--device", "cpu"]
    summary, rows = _eval(competition_math, argv, tmp_path / "m.jsonl")
    assert [r["correct"] for r in rows] == [True, True] and summary["accuracy"] == 1.0
    assert rows[0]["question"] == "1+1?"


AMC23_ROWS = [  # math-ai/amc23 as the reference's eval reads it (question, answer); a copy stores answers as floats
    {"id": 0, "question": "What is $6 \\cdot 4 + 3$?", "answer": 27.0, "url": "u"},
    {"id": 1, "question": "What is half of 5?", "answer": 2.5, "url": "u"},
]
AIME25_ROWS = [  # yentinglin/aime_2025, the set lighteval's aime25 task reads (problem, answer as text)
    {"id": "I-1", "problem": "Find $9 \\cdot 9 + 9$.", "answer": "90", "solution": "s", "url": "u", "year": "2025"},
    {"id": "I-2", "problem": "Find $2^{10}$ mod 1000.", "answer": "24", "solution": "s", "url": "u", "year": "2025"},
]


@pytest.mark.parametrize(
    "name,hub_id,split,rows,right",
    [
        ("amc23", "math-ai/amc23", "test", AMC23_ROWS, "27"),
        ("aime25", "yentinglin/aime_2025", "train", AIME25_ROWS, "90"),
    ],
)
def test_math_eval_named_competition_sets(checkpoints, tmp_path, monkeypatch, name, hub_id, split, rows, right):
    """--data amc23 / aime25 load their hub sets (id, split) and take the question and gold from their columns:
    checked on rows in each set's schema, served in place of the hub (none here)."""
    import datasets

    _, nvfp4_dir = checkpoints
    asked = []

    def hub(path, config=None, split=None, **kwargs):
        asked.append((path, config, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", hub)
    canned = [f"<think>...</think> <answer>$\\boxed{{{right}}}$</answer>", "so $\\boxed{7}$"]  # right, wrong
    monkeypatch.setattr(eval_cli, "generate", lambda spec, prompts, sampling: canned)
    argv = ["--model", nvfp4_dir, "--data", name, "--device", "cpu"]
    summary, scored = _eval(competition_math, argv, tmp_path / "m.jsonl")
    assert asked == [(hub_id, None, split)] and summary["data"] == name
    assert [r["question"] for r in scored] == [row.get("question", row.get("problem")) for row in rows]
    assert [r["gold"] for r in scored] == [str(row["answer"]) for row in rows]
    assert [r["correct"] for r in scored] == [True, False] and summary["accuracy"] == 0.5


def test_wilson_interval():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(50, 100)
    assert abs(low - 0.4038) < 1e-3 and abs(high - 0.5962) < 1e-3
