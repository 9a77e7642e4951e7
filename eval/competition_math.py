"""Competition-math accuracy (MATH-500, AIME, AMC) of a base model (NVFP4 or BF16), optionally with a LoRA adapter.

    python -m eval.competition_math --model ckpt/qwen2.5-7b-nvfp4 --adapter runs/bigmath/checkpoint-500 --data math500
    python -m eval.competition_math --model ckpt/qwen2.5-7b-nvfp4 --data aime24 --protocol greedy
    python -m eval.competition_math --model ckpt/qwen2.5-7b-nvfp4 --adapter runs/bigmath --data amc23   # aime25 alike
    python -m eval.competition_math --model ckpt/qwen2.5-7b-nvfp4 --data my_problems.jsonl   # columns: problem, answer

The prompt is Big-Math's in training (the think/answer system prompt, then the problem); a completion is correct
when qerl.rewards' math-verify reward finds its answer (a \\boxed{} one first) equal to the gold answer. Same
protocols, flags and outputs as eval.gsm8k.
Named datasets (--data; BENCHMARK below): math500, aime24, aime25 (yentinglin/aime_2025, what lighteval's aime25
task reads: the reference evaluates AIME25 with lighteval), aime and amc (AI-MO's AIME and AMC
validation sets), amc23 (math-ai/amc23, 40 problems: the AMC of the reference's own eval script).
"""

from __future__ import annotations

import sys

from eval.benchmark import Benchmark, PromptFormat
from eval.cli import run
from qerl import cli, data, rewards


def score(completion: str, gold: str) -> dict[str, bool]:
    return {"correct": rewards.math_verify_accuracy_reward([completion], [gold])[0] == 1.0}


BENCHMARK = Benchmark(
    name="competition_math",
    datasets={
        "math500": ("HuggingFaceH4/MATH-500", None, "test"),
        "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
        "aime25": ("yentinglin/aime_2025", None, "train"),  # lighteval's aime25, which the reference's README runs
        "aime": ("AI-MO/aimo-validation-aime", None, "train"),
        "amc": ("AI-MO/aimo-validation-amc", None, "train"),
        "amc23": ("math-ai/amc23", None, "test"),  # the reference eval's AMC (its eval/gsm8k.py:51): 40 problems
    },
    columns=(("problem", "question"), "answer"),
    gold=str,
    formats={"think_answer": PromptFormat(data.think_answer_prompt, score)},
    default_data="math500",
)


def main(argv: list[str] | None = None) -> int:
    run(BENCHMARK, argv if argv is not None else sys.argv[1:], __doc__)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "eval.competition_math"))
