"""Reward functions in TRL's signature: f(completions, answer, **kwargs) -> list[float | None].

The shapes follow the QeRL reference (NVlabs/QeRL utils/rewards.py):
  gsm8k     format 0.2 (<think>...</think> <answer>...</answer>) + correctness 2.0
  bigmath   format 0.2 + math-verify accuracy 1.0 on the boxed answer (None when the gold does not parse)
  dapomath  DAPO's "Answer: ..." score, 1.0 / 0.0 after Minerva-style normalisation
with one deliberate fix: GSM8K correctness compares the whole number (1,000 == 1000 == $1000.00), where the
reference compares strings in training and only the first character in its evaluation script.
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction

FORMAT_REWARD = 0.2
GSM8K_CORRECT_REWARD = 2.0


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

_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)"
# A number, optionally wrapped in $ / \boxed{} and followed by a unit word or %, nothing else.
_WHOLE_NUMBER = re.compile(
    rf"^\s*(?:\\boxed\{{)?\s*\\?\$?\s*(?P<num>{_NUMBER})\s*\}}?\s*(?:%|[a-zA-Z][a-zA-Z ]*)?\s*\.?\s*$"
)


def parse_number(text: str | None) -> Fraction | None:
    """The value of an answer that is one number (with optional $, thousands commas, unit or trailing dot)."""
    if text is None:
        return None
    match = _WHOLE_NUMBER.match(text.strip())
    if match is None:
        return None
    digits = match.group("num").replace(",", "").rstrip(".")
    try:
        return Fraction(Decimal(digits))
    except (InvalidOperation, ValueError):
        return None


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
    """2.0 when the number in <answer>...</answer> equals the gold answer as a number, else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        predicted = parse_number(extract_answer_tag(completion_text(completion)))
        expected = parse_number(str(gold))
        rewards.append(GSM8K_CORRECT_REWARD if predicted is not None and predicted == expected else 0.0)
    return rewards


# ----------------------------------------------------------------------------------------------------------
# Math-verify accuracy (Big-Math)


def math_verify_accuracy_reward(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when math-verify finds the completion's (boxed-first) answer equal to the gold, 0.0 when not, None
    when the gold itself does not parse (TRL then leaves the sample out of the reward)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    # math-verify's timeouts use signal.alarm, which only works on the main thread.
    main_thread = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if main_thread else (None, None)
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


def soft_overlong_punishment(max_completion_length: int, cache: int):
    """DAPO's soft overlong punishment (TRL's implementation): 0 up to L_max - cache, then a linear ramp to -1."""
    from trl.rewards import get_soft_overlong_punishment

    if not 0 < cache <= max_completion_length:
        raise ValueError(
            f"soft overlong cache must be in (0, max_completion_length={max_completion_length}], got {cache}"
        )
    return get_soft_overlong_punishment(max_completion_length, cache)
