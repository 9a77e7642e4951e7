"""Reward functions in TRL's signature: f(completions, answer, **kwargs) -> list[float | None].

The shapes follow the QeRL reference (NVlabs/QeRL utils/rewards.py):
  gsm8k       format 0.2 (<think>...</think> <answer>...</answer>) + correctness 2.0
  gsm8k_hash  the reference's first commit: "#### N" 1.0 + a <think> block 0.2
  gsm8k_lenient  the gsm8k_hash prompt for small models: the final answer ("#### N", else the last number) 1.0
              + "#### N" stated 0.2 + a <think> block 0.2
  bigmath     format 0.2 + math-verify accuracy 1.0 on the boxed answer (None when the gold does not parse)
  dapomath    DAPO's "Answer: ..." score, 1.0 / 0.0 after Minerva-style normalisation
with one deliberate fix: a GSM8K answer is compared as a number ("x = 18", "18 km/h", "$1,800", "\\(18\\)", a
unicode minus; LaTeX such as \\frac{36}{2} through math-verify), where the reference compared strings in training
and only the first character in its evaluation script. Text that is not one number ("18 or 19", "1,5") is wrong.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction

FORMAT_REWARD = 0.2
GSM8K_CORRECT_REWARD = 2.0
GSM8K_HASH_REWARD = 1.0


def completion_text(completion) -> str:
    """The text of a completion, conversational ([{"role": "assistant", "content": ...}]) or plain."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


# ----------------------------------------------------------------------------------------------------------
# Format

_THINK_ANSWER = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)


def think_answer_format_reward(completions, **kwargs) -> list[float]:
    """0.2 when the completion holds <think>...</think> followed by <answer>...</answer> (reference 'soft' format)."""
    return [FORMAT_REWARD if _THINK_ANSWER.search(completion_text(c)) else 0.0 for c in completions]


# ----------------------------------------------------------------------------------------------------------
# GSM8K

# A number: thousands commas only in groups of three ("1,5" is no number: 15 and 1.5 are both guesses).
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d*)?"
# One number, optionally after "x =" (one left-hand side, no list of them), wrapped in $ / \boxed{}, and followed
# by a unit (letters, /, ^, degrees: "km/h", "m^2") or %; nothing else.
_WHOLE_NUMBER = re.compile(
    rf"^\s*(?:[^=,;]*=)?\s*(?:\\boxed\{{)?\s*\\?\$?\s*(?P<num>{_NUMBER})\s*\}}?\s*"
    r"(?:%|[a-zA-Z°](?:[a-zA-Z°/ ²³]|\^\d)*)?\s*\.?\s*$"
)
# Spellings a person writes for the same thing: unicode minus signs, math delimiters, \text{} units, \!/\, spaces.
_NORMALISE = [
    (re.compile(r"[\u2212\u2012\u2013\u2014]"), "-"),
    (re.compile(r"\\[()\[\]]"), ""),
    (re.compile(r"(?<!\\)\$(.*?)(?<!\\)\$"), r"\1"),
    (re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}"), r" \1"),
    (re.compile(r"\\[,!;: ]"), ""),
]


def _normalise(text: str) -> str:
    for pattern, replacement in _NORMALISE:
        text = pattern.sub(replacement, text)
    return text.strip()


def parse_number(text: str | None) -> Fraction | None:
    """The value of an answer that is one number (with optional "x =", $, thousands commas, unit, % or trailing
    dot, in plain text or LaTeX delimiters); None for anything else (two numbers, words, "1,5")."""
    if text is None:
        return None
    match = _WHOLE_NUMBER.match(_normalise(text))
    if match is None or not any(ch.isdigit() for ch in match.group("num")):
        return None
    try:
        return Fraction(Decimal(match.group("num").replace(",", "").rstrip(".")))
    except (InvalidOperation, ValueError):
        return None


def _math_verify_timeouts() -> tuple[int | None, int | None]:
    """(parse, verify) timeouts in seconds for math-verify: its timeouts use signal.alarm, which works on the
    main thread only (elsewhere: none)."""
    return (10, 5) if threading.current_thread() is threading.main_thread() else (None, None)


def answers_equal(predicted: str | None, gold: str) -> bool:
    """Whether an extracted answer equals a GSM8K gold number: as a number when it is one, else, for LaTeX such
    as \\frac{36}{2}, by math-verify; plain text that is not one number ("18 or 19") is wrong."""
    expected = parse_number(str(gold))
    if predicted is None or expected is None:
        return False
    value = parse_number(predicted)
    if value is not None:
        return value == expected
    if "\\" not in predicted:
        return False
    from math_verify import LatexExtractionConfig, parse, verify

    parse_timeout, verify_timeout = _math_verify_timeouts()
    try:
        latex = parse(f"${_normalise(predicted)}$", [LatexExtractionConfig()], parsing_timeout=parse_timeout)
        return bool(latex) and verify(parse(str(expected)), latex, timeout_seconds=verify_timeout)
    except Exception:  # sympy can fail on exotic expressions: an unverifiable answer earns nothing
        return False


def gsm8k_gold(solution: str) -> str | None:
    """The final answer of a GSM8K solution ("... #### 1,234" -> "1234")."""
    if "####" not in solution:
        return None
    return solution.split("####")[-1].strip().replace(",", "")


def extract_answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer> (an unclosed last tag runs to the end); None without a tag."""
    if "<answer>" not in text:
        return None
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def gsm8k_correctness_reward(completions, answer, **kwargs) -> list[float]:
    """2.0 when the answer in <answer>...</answer> equals the gold answer (answers_equal), else 0.0."""
    return [
        GSM8K_CORRECT_REWARD if answers_equal(extract_answer_tag(completion_text(c)), gold) else 0.0
        for c, gold in zip(completions, answer, strict=True)
    ]


# The reference's first commit (1bf4803, paper time): the answer after "####", a <think> block.
_HASH_ANSWER = re.compile(r"####[ \t]*([^\n]*)")
_THINK = re.compile(r"<think>.+?</think>", re.DOTALL)


def gsm8k_hash_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the text after the last "####" equals the gold answer (answers_equal), else 0.0 (the reference's
    strict gsm8k_score, which compared strings)."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        found = _HASH_ANSWER.findall(completion_text(completion))
        rewards.append(GSM8K_HASH_REWARD if found and answers_equal(found[-1], gold) else 0.0)
    return rewards


_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?")
_HASH_NUMBER = re.compile(r"####[ \t]*[-+]?\$?\d")


def final_answer(text: str) -> str | None:
    """What a GSM8K completion gives as its answer, leniently: the text after the last "####" if it has one, else
    its last number (a small model's "The answer is: 18" or "... = 18 apples.")."""
    found = _HASH_ANSWER.findall(text)
    if found:
        return found[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace("$", "") if numbers else None


def gsm8k_final_answer_reward(completions, answer, **kwargs) -> list[float]:
    """gsm8k_lenient: 1.0 when final_answer equals the gold answer (answers_equal), else 0.0."""
    return [
        GSM8K_HASH_REWARD if answers_equal(final_answer(completion_text(c)), gold) else 0.0
        for c, gold in zip(completions, answer, strict=True)
    ]


def hash_format_reward(completions, **kwargs) -> list[float]:
    """0.2 when the completion states a number after "####", the format the gsm8k_hash instruction asks for."""
    return [FORMAT_REWARD if _HASH_NUMBER.search(completion_text(c)) else 0.0 for c in completions]


def think_reward(completions, **kwargs) -> list[float]:
    """0.2 when the completion holds a non-empty <think>...</think> block (the reference's think_reward_func)."""
    return [FORMAT_REWARD if _THINK.search(completion_text(c)) else 0.0 for c in completions]


# ----------------------------------------------------------------------------------------------------------
# Math-verify accuracy (Big-Math)


def math_verify_accuracy_reward(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when math-verify finds the completion's (boxed-first) answer equal to the gold, 0.0 when not, None
    when the gold itself does not parse (TRL then leaves the sample out of the reward)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    parse_timeout, verify_timeout = _math_verify_timeouts()
    prediction_config = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False, malformed_operators=False, basic_latex=True, equations=True, boxed="all", units=True
            ),
            boxed_match_priority=0,  # a \boxed{} answer wins over any other latex in the text
            try_extract_without_anchor=False,
        )
    ]
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        gold_parsed = parse(str(gold), extraction_mode="first_match", parsing_timeout=parse_timeout)
        if not gold_parsed:
            rewards.append(None)
            continue
        predicted = parse(
            completion_text(completion),
            extraction_config=prediction_config,
            extraction_mode="first_match",
            parsing_timeout=parse_timeout,
        )
        try:
            rewards.append(float(verify(gold_parsed, predicted, timeout_seconds=verify_timeout)))
        except Exception:  # sympy can fail on exotic expressions: an unverifiable answer earns nothing
            rewards.append(0.0)
    return rewards


# ----------------------------------------------------------------------------------------------------------
# DAPO "Answer:" score (Minerva normalisation, as in DAPO's math_dapo.compute_score)

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]  # fmt: skip
_REMOVED = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
]  # fmt: skip


def normalize_final_answer(text: str) -> str:
    """Minerva's answer normalisation: drop units and decorations, unwrap \\text/\\boxed, canonical \\frac."""
    text = text.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expression in _REMOVED:
        text = text.replace(expression, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text)
    text = re.sub(r"(\\text\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text)
    text = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", text)
    text = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last "Answer: X" line (in the last 300 characters) matches the gold after normalisation."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        tail = completion_text(completion)[-300:]  # the longest MATH-500 answer has 159 characters
        found = _ANSWER_LINE.findall(tail)
        predicted = normalize_final_answer(found[-1]) if found else None
        rewards.append(1.0 if predicted is not None and predicted == normalize_final_answer(str(gold)) else 0.0)
    return rewards


# ----------------------------------------------------------------------------------------------------------
# Synthetic task


def exact_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion, stripped, is exactly the answer (the built-in arithmetic task)."""
    return [
        1.0 if completion_text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer, strict=True)
    ]


# Marks a reward function that pays for a completion's length, not for solving the task: the trainer leaves such
# functions out of what a completion "earned" (its truncated vs finished reward metrics).
_LENGTH_RULE = "qerl_length_rule"


def is_length_rule(func) -> bool:
    return getattr(func, _LENGTH_RULE, False)


def soft_overlong_punishment(max_completion_length: int, cache: int):
    """DAPO's soft overlong punishment (TRL's implementation): 0 up to L_max - cache, then a linear ramp to -1."""
    from trl.rewards import get_soft_overlong_punishment

    if not 0 < cache <= max_completion_length:
        raise ValueError(
            f"soft overlong cache must be in (0, max_completion_length={max_completion_length}], got {cache}"
        )
    punishment = get_soft_overlong_punishment(max_completion_length, cache)
    setattr(punishment, _LENGTH_RULE, True)
    return punishment
