"""eval.competition_math (eval/competition_math.py): boxed answers scored through qerl.rewards' math-verify reward on a
local file and on the named competition sets, and bad input refused in one line (its TRIALS)."""

import json

import pytest
from bad_input import E, check_trial, trial_ids
from eval_runs import _eval

from eval import cli as eval_cli
from eval import competition_math
from qerl import input_checks


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
    checked = []  # the hub's reachability check answers as a reachable hub would
    monkeypatch.setattr(input_checks, "check_hub_dataset", lambda repo_id, *args: checked.append(repo_id))
    canned = [f"<think>...</think> <answer>$\\boxed{{{right}}}$</answer>", "so $\\boxed{7}$"]  # right, wrong
    monkeypatch.setattr(eval_cli, "generate", lambda spec, prompts, sampling: canned)
    argv = ["--model", nvfp4_dir, "--data", name, "--device", "cpu"]
    summary, scored = _eval(competition_math, argv, tmp_path / "m.jsonl")
    assert asked == [(hub_id, None, split)] and checked == [hub_id] and summary["data"] == name
    assert [r["question"] for r in scored] == [row.get("question", row.get("problem")) for row in rows]
    assert [r["gold"] for r in scored] == [str(row["answer"]) for row in rows]
    assert [r["correct"] for r in scored] == [True, False] and summary["accuracy"] == 0.5


TRIALS = [
    # prog, argv, fragment(s) of the one line
    ("eval.competition_math", [*E[:2], "--data", "nocolumn.jsonl"], "column(s) answer"),
    ("eval.competition_math", [*E[:2], "--data", "math501"], "--data math501: unknown dataset (did you mean math500?)"),
]


@pytest.mark.parametrize("trial", TRIALS, ids=trial_ids(TRIALS))
def test_bad_input_is_one_line_and_changes_nothing(world, monkeypatch, capsys, trial):
    check_trial(world, monkeypatch, capsys, trial)
