"""Training tasks: prompts (TRL's conversational format) plus the reward functions that score them.

Named datasets use the QeRL reference's hub ids and prompt formats (NVlabs/QeRL utils/data.py):
  gsm8k        openai/gsm8k (main): the think/answer system prompt (which the rewards pay for) + the question,
               gold = the number after ####. The reference HEAD defines that system prompt but comments out its
               message, sending the bare question to rewards that pay only for the tags: a bug not reproduced here.
  gsm8k_hash   the same rows as the reference's first commit (1bf4803, paper time) posed them: its "####"
               instruction appended to the question, "#### N" scored (1.0) plus a <think> block (0.2)
  gsm8k_lenient the gsm8k_hash prompt, scored for models too small to follow it: the final answer ("#### N", else
               the last number) 1.0, "#### N" stated 0.2, a <think> block 0.2
  bigmath      open-r1/Big-Math-RL-Verified-Processed (level_3_4_5), the processed release of
               SynthLabsAI/Big-Math-RL-Verified; think/answer system prompt; prompts <= 1024 characters
  bigmath_hard the same, level_4_5
  dapomath     open-r1/DAPO-Math-17k-Processed (en), the processed release of BytedTsinghua-SIA/DAPO-Math-17k;
               its own prompt (asks for "Answer: ..."); prompts <= 1024 characters
  arithmetic   built in, no download: "23+45=" -> "68"
Any local JSONL / JSON / parquet / CSV file works too, in one of those formats (picked from its columns, or
named with `dataset_format`).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from qerl import rewards

if TYPE_CHECKING:  # datasets loads with the data, not with the command line's --help (tests/test_cli_imports.py)
    from datasets import Dataset

THINK_ANSWER_SYSTEM_PROMPT = (
    "\n        Solve the following math problem step by step. The reasoning process and direct answer are enclosed "
    "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think> <answer> answer here </answer>: \n        <think>\n        ...\n        </think>\n        <answer>\n"
    "        ...\n        </answer>\n    "
)  # verbatim from the reference, indentation included: it is what its models were trained on

GSM8K_HASH_INSTRUCTION = (
    '\n        Let\'s think step by step first within <think> </think> tags, and output the final answer after "####" '
    "tag, i.e.,: \n        #     <think>\n        #     ...\n        #     </think>\n        #     #### number\n    "
)  # verbatim from the reference's first commit, appended to the question after a space

MAX_PROMPT_CHARS = 1024  # the reference drops longer Big-Math / DAPO prompts
# GSM8K rows a clone carries (MIT licensed): train_sample.jsonl (256 training rows), test_sample.jsonl (128 test rows)
GSM8K_DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k"


@dataclass(frozen=True)
class HubSource:
    path: str
    name: str | None
    format: str


HUB_DATASETS = {
    "gsm8k": HubSource("openai/gsm8k", "main", "gsm8k"),
    "gsm8k_hash": HubSource("openai/gsm8k", "main", "gsm8k_hash"),
    "gsm8k_lenient": HubSource("openai/gsm8k", "main", "gsm8k_lenient"),
    "bigmath": HubSource("open-r1/Big-Math-RL-Verified-Processed", "level_3_4_5", "bigmath"),
    "bigmath_hard": HubSource("open-r1/Big-Math-RL-Verified-Processed", "level_4_5", "bigmath"),
    "dapomath": HubSource("open-r1/DAPO-Math-17k-Processed", "en", "dapomath"),
}
BUILTIN_DATASETS = ("arithmetic",)
KNOWN_DATASETS = (*HUB_DATASETS, *BUILTIN_DATASETS)

# Columns each format reads, in the order auto-detection tries them.
FORMAT_COLUMNS = {
    "gsm8k": ("question", "answer"),
    "gsm8k_hash": ("question", "answer"),  # never auto-detected: gsm8k comes first
    "gsm8k_lenient": ("question", "answer"),
    "dapomath": ("source_prompt", "solution"),
    "bigmath": ("prompt", "solution"),
    "arithmetic": ("prompt", "answer"),
}
LOCAL_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass
class Task:
    """A dataset with `prompt` (list of messages) and `answer` columns, and the rewards that score it."""

    name: str
    format: str
    train: Dataset
    reward_funcs: list[Callable] = field(default_factory=list)


def reward_funcs_for(fmt: str) -> list[Callable]:
    if fmt == "gsm8k":
        return [rewards.think_answer_format_reward, rewards.gsm8k_correctness_reward]
    if fmt == "gsm8k_hash":
        return [rewards.gsm8k_hash_reward, rewards.think_reward]
    if fmt == "gsm8k_lenient":
        return [rewards.gsm8k_final_answer_reward, rewards.hash_format_reward, rewards.think_reward]
    if fmt == "bigmath":
        return [rewards.think_answer_format_reward, rewards.math_verify_accuracy_reward]
    if fmt == "dapomath":
        return [rewards.dapo_answer_reward]
    if fmt == "arithmetic":
        return [rewards.exact_answer_reward]
    raise ValueError(f"unknown dataset format {fmt!r}; known formats: {', '.join(FORMAT_COLUMNS)}")


# ----------------------------------------------------------------------------------------------------------
# Formatting rows into prompts


def think_answer_prompt(question: str) -> list[dict]:
    """The reference's think/answer system prompt, then the question (GSM8K, Big-Math; the evals too)."""
    return [{"role": "system", "content": THINK_ANSWER_SYSTEM_PROMPT}, {"role": "user", "content": question}]


def gsm8k_hash_prompt(question: str) -> list[dict]:
    """The question with the "####" instruction of the reference's first commit appended, no system prompt."""
    return [{"role": "user", "content": f"{question} {GSM8K_HASH_INSTRUCTION}"}]


def _format_gsm8k(row):
    return {"prompt": think_answer_prompt(row["question"]), "answer": rewards.gsm8k_gold(row["answer"])}


def _format_gsm8k_hash(row):
    return {"prompt": gsm8k_hash_prompt(row["question"]), "answer": rewards.gsm8k_gold(row["answer"])}


def _format_bigmath(row):
    return {"prompt": think_answer_prompt(row["prompt"]), "answer": row["solution"]}


def _format_dapomath(row):
    return {"prompt": row["source_prompt"], "answer": row["solution"]}


def _format_arithmetic(row):
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    return {"prompt": prompt, "answer": str(row["answer"])}


_FORMATTERS = {
    "gsm8k": _format_gsm8k,
    "gsm8k_hash": _format_gsm8k_hash,
    "gsm8k_lenient": _format_gsm8k_hash,  # the same prompt; only the rewards differ
    "bigmath": _format_bigmath,
    "dapomath": _format_dapomath,
    "arithmetic": _format_arithmetic,
}


def format_row(row: dict, fmt: str) -> dict:
    """One raw row of format `fmt` as a training row: its prompt (chat messages) and gold answer."""
    return _FORMATTERS[fmt](row)


def _prompt_chars(row, fmt: str) -> int:
    if fmt == "bigmath":
        return len(row["prompt"])
    if fmt == "dapomath":
        return len(row["source_prompt"][0]["content"])
    return 0


def format_dataset(dataset: Dataset, fmt: str, source: str = "dataset") -> Dataset:
    """Turn raw rows of format `fmt` into `prompt` / `answer` rows (other columns are kept for rewards)."""
    if fmt not in FORMAT_COLUMNS:
        raise ValueError(f"unknown dataset format {fmt!r}; known formats: {', '.join(FORMAT_COLUMNS)}")
    for column in FORMAT_COLUMNS[fmt]:
        if column not in dataset.column_names:
            raise ValueError(
                f"{source}: format {fmt!r} needs a column {column!r}, which is missing "
                f"(columns: {', '.join(dataset.column_names)})"
            )
    from datasets import Value

    if fmt in ("bigmath", "dapomath"):
        dataset = dataset.filter(lambda row: _prompt_chars(row, fmt) <= MAX_PROMPT_CHARS)
    # Drop the raw columns the formatter reads, so `prompt` and `answer` come back with their new types.
    dataset = dataset.map(_FORMATTERS[fmt], remove_columns=list(FORMAT_COLUMNS[fmt]))
    if dataset.features["answer"] != Value("string"):  # map keeps an int column's type; rewards want text
        dataset = dataset.cast_column("answer", Value("string"))
    return dataset


def detect_format(column_names: list[str], source: str = "dataset") -> str:
    for fmt, columns in FORMAT_COLUMNS.items():
        if all(c in column_names for c in columns):
            return fmt
    wanted = "; ".join(f"{fmt}: {', '.join(cols)}" for fmt, cols in FORMAT_COLUMNS.items())
    raise ValueError(
        f"{source}: cannot tell the dataset format from its columns ({', '.join(column_names)}). "
        f"Formats and the columns they need: {wanted}. Rename the columns or pass dataset_format."
    )


# ----------------------------------------------------------------------------------------------------------
# The built-in arithmetic task


def arithmetic_dataset(num_examples: int = 2000, seed: int = 0, max_operand: int = 20) -> Dataset:
    """Problems "a+b=" / "a-b=" with non-negative results; the answer is the decimal result."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for _ in range(num_examples):
        op = rng.choice("+-")
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        result = a + b if op == "+" else a - b
        rows["prompt"].append([{"role": "user", "content": f"{a}{op}{b}="}])
        rows["answer"].append(str(result))
    return Dataset.from_dict(rows)


# ----------------------------------------------------------------------------------------------------------
# Entry point


def _load_local(path: str, split: str) -> Dataset:
    ext = os.path.splitext(path)[1].lower()
    if ext not in LOCAL_EXTENSIONS:
        raise ValueError(f"{path}: unsupported file type {ext!r}; use one of {', '.join(LOCAL_EXTENSIONS)}")
    from datasets import load_dataset

    return load_dataset(LOCAL_EXTENSIONS[ext], data_files={split: path}, split=split)


def load_task(
    dataset: str,
    split: str = "train",
    dataset_format: str = "auto",
    num_examples: int | None = None,
    seed: int = 0,
) -> Task:
    """Load a named dataset (see KNOWN_DATASETS), the built-in arithmetic task, or a local file."""
    if dataset == "arithmetic":
        train = arithmetic_dataset(num_examples or 2000, seed=seed + (0 if split == "train" else 1))
        return Task(dataset, "arithmetic", train, reward_funcs_for("arithmetic"))
    if dataset in HUB_DATASETS:
        from datasets import load_dataset

        source = HUB_DATASETS[dataset]
        raw = load_dataset(source.path, source.name, split=split)
        fmt = source.format
    elif os.path.exists(dataset):
        raw = _load_local(dataset, split)
        fmt = detect_format(raw.column_names, dataset) if dataset_format == "auto" else dataset_format
    else:
        raise ValueError(
            f"unknown dataset {dataset!r}: known datasets are {', '.join(KNOWN_DATASETS)}, "
            "or give the path of a local .jsonl / .json / .parquet / .csv file"
        )
    if num_examples is not None:
        raw = raw.select(range(min(num_examples, len(raw))))
    return Task(dataset, fmt, format_dataset(raw, fmt, dataset), reward_funcs_for(fmt))


def drop_long_prompts(dataset: Dataset, tokenizer, max_prompt_length: int | None) -> Dataset:
    """Drop rows whose chat-templated prompt exceeds max_prompt_length tokens (TRL 1.16 no longer truncates
    prompts; dropping keeps every prompt whole, where truncation would cut questions)."""
    if not max_prompt_length:
        return dataset

    def fits(row):
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return len(ids) <= max_prompt_length

    return dataset.filter(fits)


LONG_PROMPTS = ("drop", "keep_last")  # what `fit_prompts` does with a prompt over the cap


def keep_last_prompt_tokens(dataset: Dataset, tokenizer, max_prompt_length: int | None) -> Dataset:
    """Every prompt as the text its chat template makes (TRL then tokenizes it as plain text, to the same ids), and
    one over max_prompt_length tokens cut to its last max_prompt_length tokens: the QeRL reference's handling (its
    TRL 0.21 trainer keeps the last tokens, NVlabs/QeRL trl_trainer/grpo_trainer.py:1511-1524), which cuts the
    system prompt and the start of the question but keeps every row. The cut is decoded with its special tokens, as
    the reference hands vLLM; should the text tokenize longer at the cut, one token fewer is kept."""
    if not max_prompt_length:
        return dataset
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer("")["input_ids"][:1] == [tokenizer.bos_token_id]

    def cut(row):
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        if adds_bos and text.startswith(bos):
            text = text[len(bos) :]  # the template wrote it and the tokenizer adds it: once is the chat's ids
        if len(tokenizer(text)["input_ids"]) <= max_prompt_length:
            return {"prompt": text}
        body = tokenizer(text, add_special_tokens=False)["input_ids"]
        keep = max_prompt_length - int(adds_bos)
        while True:
            text = tokenizer.decode(body[-keep:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if keep == 1 or len(tokenizer(text)["input_ids"]) <= max_prompt_length:
                return {"prompt": text}
            keep -= 1

    return dataset.map(cut)


def fit_prompts(dataset: Dataset, tokenizer, max_prompt_length: int | None, long_prompts: str = "drop") -> Dataset:
    """The training rows under the prompt cap: over-long prompts dropped (default) or cut to their last tokens."""
    if long_prompts not in LONG_PROMPTS:
        raise ValueError(f"unknown long_prompts {long_prompts!r}; use one of {', '.join(LONG_PROMPTS)}")
    fit = keep_last_prompt_tokens if long_prompts == "keep_last" else drop_long_prompts
    return fit(dataset, tokenizer, max_prompt_length)
