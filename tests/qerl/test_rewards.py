import json
import os

import pytest

from benchmarks.launch import SHARED_GSM8K
from qerl import data, rewards

GSM8K_TEST = SHARED_GSM8K / "test.jsonl"


def _msg(text):
    return [{"role": "assistant", "content": text}]


def _gsm8k_rows():
    if not os.path.exists(GSM8K_TEST):
        pytest.skip(f"GSM8K test set not found at {os.path.normpath(GSM8K_TEST)} (expected ../shared beside the repo)")
    with open(GSM8K_TEST) as f:
        return [json.loads(line) for line in f]


def _as_completion(solution: str, final: str) -> list[dict]:
    """A GSM8K gold solution written the way the reward asks: reasoning in <think>, the number in <answer>."""
    reasoning = solution.split("####")[0].strip()
    return _msg(f"<think>\n{reasoning}\n</think>\n<answer>\n{final}\n</answer>")


def test_gsm8k_gold_solutions_all_score_correct():
    rows = _gsm8k_rows()
    answers = [rewards.gsm8k_gold(r["answer"]) for r in rows]
    completions = [_as_completion(r["answer"], a) for r, a in zip(rows, answers, strict=True)]
    assert len(rows) == 1319
    assert rewards.gsm8k_correctness_reward(completions, answers) == [2.0] * len(rows)
    assert rewards.think_answer_format_reward(completions) == [0.2] * len(rows)
    # The final line as written in the solution ("#### 1,234" style answers keep their commas there).
    raw_finals = [r["answer"].split("####")[-1].strip() for r in rows]
    completions = [_as_completion(r["answer"], f) for r, f in zip(rows, raw_finals, strict=True)]
    assert rewards.gsm8k_correctness_reward(completions, answers) == [2.0] * len(rows)


def test_gsm8k_wrong_answers_score_zero():
    rows = _gsm8k_rows()
    answers = [rewards.gsm8k_gold(r["answer"]) for r in rows]
    wrong = [str(int(a) + 1) if a.lstrip("-").isdigit() else a + "1" for a in answers]
    completions = [_as_completion(r["answer"], w) for r, w in zip(rows, wrong, strict=True)]
    assert rewards.gsm8k_correctness_reward(completions, answers) == [0.0] * len(rows)
    # Only the first character right (what the reference's eval compares) is still wrong here.
    first_char = [a[0] + "9" * len(a) for a in answers]
    completions = [_as_completion(r["answer"], w) for r, w in zip(rows, first_char, strict=True)]
    assert rewards.gsm8k_correctness_reward(completions, answers) == [0.0] * len(rows)


# Answers a person would accept for 18 (or -5), and answers they would not.
RIGHT = [
    ("18", "18"),
    ("$18", "18"),
    ("18 dollars", "18"),
    ("18.00", "18"),
    ("18.", "18"),
    ("\\boxed{18}", "18"),
    ("x = 18", "18"),
    ("3 * 6 = 18", "18"),
    ("18 km/h", "18"),
    ("18 m^2", "18"),
    ("18%", "18"),
    ("\\(18\\)", "18"),
    ("$18$", "18"),
    ("\\$18", "18"),
    ("18\\text{ km}", "18"),
    ("\\frac{36}{2}", "18"),
    ("\\dfrac{36}{2}", "18"),
    ("1,800", "1800"),
    ("1800", "1,800"),
    ("\u22125", "-5"),
    ("-5", "-5"),
    ("\u20135", "-5"),
    ("0.5", ".5"),
]
WRONG = [
    ("180", "18"), ("1", "18"), ("18 or 19", "18"), ("18 19", "18"), ("x = 18, y = 19", "19"), ("", "18"),
    ("eighteen", "18"), ("1,5", "15"), ("1,5", "1.5"), ("1,80", "180"), ("5", "-5"), ("18 apples and 3 pears", "3"),
    ("18 apples and 3 pears", "18"), ("\\frac{36}{3}", "18"), ("-18", "18"),
]  # fmt: skip


@pytest.mark.parametrize("text,gold,score", [(t, g, 2.0) for t, g in RIGHT] + [(t, g, 0.0) for t, g in WRONG])
def test_gsm8k_answer_parsing(text, gold, score):
    completion = _msg(f"<think>t</think><answer>{text}</answer>")
    assert rewards.gsm8k_correctness_reward([completion], [gold]) == [score]


@pytest.mark.parametrize("text,gold,score", [(t, g, 1.0) for t, g in RIGHT] + [(t, g, 0.0) for t, g in WRONG])
def test_gsm8k_hash_answer_parsing(text, gold, score):
    """The reference's first-commit reward, with the same answer comparison."""
    assert rewards.gsm8k_hash_reward([_msg(f"<think>t</think>\n#### {text}\n")], [gold]) == [score]


def test_gsm8k_hash_format():
    assert rewards.gsm8k_hash_reward([_msg("#### 5\nno, wait: #### 18")], ["18"]) == [1.0]  # the last one counts
    assert rewards.gsm8k_hash_reward([_msg("the answer is 18")], ["18"]) == [0.0]
    assert rewards.think_reward([_msg("<think>a\nb</think>#### 1"), _msg("<think></think>"), "x"]) == [0.2, 0, 0]


@pytest.mark.parametrize(
    "text, final, hash_format",
    [
        ("The answer is: 18", 1.0, 0.0),  # what SmolLM2-135M-Instruct writes
        ("3 + 15 = 18 apples.", 1.0, 0.0),  # the last number
        ("#### 18", 1.0, 0.2),
        ("#### 5\nso in total 18", 0.0, 0.2),  # "####" given: it is the answer, not the later number
        ("18, or maybe 19", 0.0, 0.0),
        ("#### eighteen", 0.0, 0.0),  # "####" without a number: no format reward either
        ("no number at all", 0.0, 0.0),
        ("$1,800 is the cost... The answer is: $18", 1.0, 0.0),
    ],
)
def test_gsm8k_lenient_rewards(text, final, hash_format):
    assert rewards.gsm8k_final_answer_reward([_msg(text)], ["18"]) == [final]
    assert rewards.hash_format_reward([_msg(text)]) == [hash_format]
    assert [f.__name__ for f in data.reward_funcs_for("gsm8k_lenient")] == [
        "gsm8k_final_answer_reward",
        "hash_format_reward",
        "think_reward",
    ]


def test_gsm8k_needs_the_answer_tag_and_format():
    assert rewards.gsm8k_correctness_reward([_msg("The answer is 18")], ["18"]) == [0.0]
    assert rewards.think_answer_format_reward([_msg("<answer>18</answer>")]) == [0.0]
    assert rewards.think_answer_format_reward(["<think>a\nb</think>\n<answer>1</answer>"]) == [0.2]  # plain text too


def test_math_verify_accuracy():
    completions = [_msg(r"so \boxed{\frac{1}{2}}"), _msg(r"\boxed{0.5}"), _msg(r"\boxed{3}"), _msg("no idea")]
    assert rewards.math_verify_accuracy_reward(completions, [r"\frac{1}{2}"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert rewards.math_verify_accuracy_reward([_msg(r"\boxed{1}")], ["not math at all"]) == [None]


def test_dapo_answer_score():
    completions = [
        _msg("work...\nAnswer: 42"),
        _msg("Answer: 41\nmore work\nAnswer: $\\frac{1}{2}$"),
        _msg("Answer: 1,000 dollars"),
        _msg("Answer: 43"),
        _msg("42"),
    ]
    gold = ["42", "\\frac{1}{2}", "1000", "42", "42"]
    assert rewards.dapo_answer_reward(completions, gold) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert rewards.normalize_final_answer("\\text{5 cm}") == "5"
    assert rewards.normalize_final_answer("x = \\frac12") == "\\frac{1}{2}"


def test_exact_answer_and_overlong():
    assert rewards.exact_answer_reward([_msg(" 68"), _msg("68 "), _msg("6"), "68"], ["68"] * 4) == [1.0, 1.0, 0.0, 1.0]
    punish = rewards.soft_overlong_punishment(100, 20)
    assert punish(completion_ids=[[1] * 50, [1] * 90, [1] * 100]) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError):
        rewards.soft_overlong_punishment(100, 0)
