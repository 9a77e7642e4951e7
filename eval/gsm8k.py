r"""GSM8K accuracy of a base model (NVFP4 or BF16), optionally with a trained LoRA adapter.

    python -m eval.gsm8k --model ckpt/qwen2.5-7b-nvfp4 --adapter runs/dapo/checkpoint-500
    python -m eval.gsm8k --model Qwen/Qwen2.5-7B-Instruct --protocol greedy --limit 100
    python -m eval.gsm8k --model Qwen/Qwen2.5-7B-Instruct --data tests/data/gsm8k/test_sample.jsonl --protocol greedy
    python -m eval.gsm8k --data arithmetic --protocol greedy --max-new-tokens 6 \
        --model runs/demo/checkpoints/nvfp4 --adapter runs/demo/adapter    # after `make demo`: its task and adapter

--data gsm8k (the default) reads the GSM8K test set from the hub (openai/gsm8k); a clone carries 128 of its problems
in tests/data/gsm8k/test_sample.jsonl. Protocols (eval/protocols.py): `reference` (default; the QeRL reference's
eval: temperature 0.6, top-p 0.95, 1024 new tokens, seeded) or `greedy`. Formats, as the training datasets pose
GSM8K: `think_answer` (default; the reference eval's think/answer system prompt): a completion is correct when the
training reward pays for it (the number inside <answer>...</answer> equals the gold one as a number); `gsm8k_hash`
(the question with the "####" instruction): the number after the last "####". Prints the accuracy with its 95%
interval; writes every completion to --out, whose first line (the summary) also reports a looser score,
accuracy_flexible: the last number of a completion without an answer tag (or without "####") counts too. The
reference's script compared the first character only.
"""

from __future__ import annotations

import re
import sys

from eval.benchmark import Benchmark, PromptFormat
from eval.cli import run
from qerl import cli, data, rewards

_LAST_NUMBER = re.compile(r"[-+]?\$?\d[\d,]*(?:\.\d+)?")


def _last_number_is(completion: str, gold: str) -> bool:
    numbers = _LAST_NUMBER.findall(completion)
    last = rewards.parse_number(numbers[-1].replace("$", "")) if numbers else None
    return last is not None and last == rewards.parse_number(gold)


def score(completion: str, gold: str) -> dict[str, bool]:
    """correct: the training reward's check; flexible: that, or (no answer tag) the last number equals gold."""
    strict = rewards.gsm8k_correctness_reward([completion], [gold])[0] > 0
    untagged = rewards.extract_answer_tag(completion) is None
    return {"correct": strict, "flexible": strict or (untagged and _last_number_is(completion, gold))}


def score_hash(completion: str, gold: str) -> dict[str, bool]:
    """gsm8k_hash: correct when the gsm8k_hash reward pays ("#### N" equals gold); flexible: that, or (no "####")
    the last number equals gold."""
    strict = rewards.gsm8k_hash_reward([completion], [gold])[0] > 0
    return {"correct": strict, "flexible": strict or ("####" not in completion and _last_number_is(completion, gold))}


def _arithmetic(limit: int | None):
    """The demo's task on problems of its own seed (the demo trains on seed 1): its bare prompt, exact answers."""
    problems = data.arithmetic_dataset(limit or 500, seed=10_000)
    rows = [
        {"prompt": p, "question": p[-1]["content"], "gold": a}
        for p, a in zip(problems["prompt"], problems["answer"], strict=True)
    ]
    return rows, lambda completion, gold: {"correct": rewards.exact_answer_reward([completion], [gold])[0] == 1.0}


BENCHMARK = Benchmark(
    name="gsm8k",
    datasets={"gsm8k": ("openai/gsm8k", "main", "test")},
    columns=(("question",), "answer"),
    gold=rewards.gsm8k_gold,
    formats={
        "think_answer": PromptFormat(data.think_answer_prompt, score),
        "gsm8k_hash": PromptFormat(data.gsm8k_hash_prompt, score_hash),
    },
    default_data="gsm8k",
    builtin={"arithmetic": _arithmetic},
    local_rows=str(data.GSM8K_DATA / "test_sample.jsonl"),
)


def main(argv: list[str] | None = None) -> int:
    run(BENCHMARK, argv if argv is not None else sys.argv[1:], __doc__)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "eval.gsm8k"))
