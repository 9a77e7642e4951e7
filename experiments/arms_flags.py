"""The flags of `python -m experiments.arms`: every command's settings, apart from what the commands run
(experiments/arms.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.launch import SHARED_GSM8K
from experiments.arms_runs import ARMS, EVAL_FORMATS, PAPER_ARMS, PROTOCOLS
from qerl import cli


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _steps(text: str) -> str | int:
    return text if text == "auto" else int(text)


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("prepare", "probe", "sweep", "train", "report"))
    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a fetchable model (python -m qerl.models list) or a BF16 checkpoint folder",
    )
    parser.add_argument("--recipe", type=Path, help="training recipe (default: the model's, benchmarks.launch.RECIPES)")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("ckpt"), help="where its BF16 and NVFP4 folders go")
    parser.add_argument("--out", type=Path, default=Path("runs/arms"))
    parser.add_argument("--png", type=Path, help="the report's plot (default: OUT/arms.png)")
    shared = SHARED_GSM8K
    parser.add_argument("--train-data", type=Path, default=shared / "train.jsonl")
    parser.add_argument("--test-data", type=Path, default=shared / "test.jsonl")
    parser.add_argument(
        "--format",
        default="gsm8k_hash",
        choices=list(EVAL_FORMATS),
        help="training dataset format (its prompt and rewards; the probe's choice)",
    )
    parser.add_argument(
        "--formats", type=cli.comma_list(EVAL_FORMATS), default=list(EVAL_FORMATS), help="probe: candidates"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout temperature")
    parser.add_argument("--temperatures", type=_floats, default=[1.0], help="probe: candidates")
    parser.add_argument("--probe-prompts", type=int, default=32, help="probe: train prompts per candidate")
    parser.add_argument("--probe-tokens", type=int, default=512, help="probe: new tokens per sample")
    parser.add_argument("--probe-batch", type=int, default=64, help="probe: sequences per batch (CPU generate)")
    parser.add_argument(
        "--arms", type=cli.comma_list(ARMS), default=list(PAPER_ARMS), help="train: the arms run (default: the paper's)"
    )
    parser.add_argument("--steps", type=_steps, default=150, help="steps per run; train: 'auto' fits --finish-by")
    parser.add_argument("--finish-by", type=float, help="unix time by which training and evaluations must end")
    parser.add_argument("--eval-minutes", type=float, default=4.0, help="--steps auto: time kept for evaluations")
    parser.add_argument("--step-margin", type=float, default=1.1, help="--steps auto: on the sweep's seconds per step")
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=60,
        help="--steps auto: a run's start (loading, compiling, the first step) before its steps",
    )
    parser.add_argument("--min-steps", type=int, default=30, help="--steps auto: refuse to train fewer")
    parser.add_argument("--lr", type=float, help="train: one learning rate for all arms (default: the sweep's per arm)")
    parser.add_argument("--lrs", type=_floats, default=[3e-5, 1e-4, 3e-4], help="sweep: learning rates")
    parser.add_argument(
        "--sweep-arms",
        type=cli.comma_list(ARMS),
        default=["bf16_lora", "nvfp4_lora"],
        help="sweep: the arms swept (the others take the rate of their precision's)",
    )
    parser.add_argument(
        "--sweep-seeds",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[100, 101],
        help="sweep: seeds no train run uses",
    )
    parser.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",")], default=[0, 1, 2])
    parser.add_argument(
        "--checkpoints",
        type=int,
        default=0,
        help="train: intermediate checkpoints of the first seed's runs evaluated (evenly spaced)",
    )
    parser.add_argument(
        "--gpu-ids",
        type=lambda t: [int(x) for x in t.split(",") if x],
        help="GPUs to spread runs over, e.g. 1,2,3 (default: all visible; none on CPU)",
    )
    parser.add_argument("--per-gpu", type=int, default=3, help="runs at a time on each GPU")
    parser.add_argument(
        "--mps", action="store_true", help="share each GPU's SMs between its runs through CUDA MPS (starts the daemon)"
    )
    parser.add_argument(
        "--recipe-sha256",
        help="report: pool the runs of this version of the recipe (a prefix of its SHA-256, as the records carry "
        "it; default: the recipe file as it is now, where runs of it are recorded)",
    )
    parser.add_argument(
        "--results",
        type=Path,
        help="train: where each finished run's record goes (a run recorded there is not run again); report: the "
        "records read (default: results/arms/MODEL, committed with the code)",
    )
    parser.add_argument(
        "--run-minutes",
        type=float,
        help="train with --finish-by: a run's expected minutes (training and evaluations) until one has finished, "
        "then the longest finished run's; a run that would end past the deadline is not started",
    )
    parser.add_argument(
        "--bases", action="store_true", help="train: evaluate the bases without an adapter too (unless recorded)"
    )
    parser.add_argument(
        "--other-base",
        action="store_true",
        help="train: also evaluate each adapter greedily on the other precision's base (BF16-trained on NVFP4 and the "
        "reverse), after its own evaluations",
    )
    parser.add_argument("--report-steps", type=int, help="report: the step count pooled (default: the most common)")
    parser.add_argument(
        "--sharing",
        choices=("alone", "shared", "mps"),
        help="report: the packing of runs on GPUs pooled in the arms table (default: the most common)",
    )
    parser.add_argument(
        "--protocols", type=cli.comma_list(PROTOCOLS), default=list(PROTOCOLS), help="eval protocols of every run"
    )
    parser.add_argument("--eval-tokens", type=int, default=512, help="new tokens per eval answer")
    parser.add_argument("--eval-kv-gib", type=float, default=4.0, help="KV cache budget of each eval (GiB)")
    parser.add_argument("--eval-limit", type=int, help="evaluate the first N test problems only (smoke runs)")
    parser.add_argument(
        "--train-flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="the rest of the command line goes to every qerl.train run",
    )
    return parser
