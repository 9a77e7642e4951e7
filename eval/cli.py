"""The command line eval.gsm8k and eval.competition_math share: the flags, the checks of the model, adapter and data
before anything loads, the run (generate, score) and its outputs: the accuracy with its 95% interval on stdout and a
JSONL whose first line is the summary and whose other lines are the samples.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict
from pathlib import Path

from eval.benchmark import Benchmark, score_samples
from eval.generate import ModelSpec, generate
from eval.protocols import PROTOCOLS, Sampling
from qerl import cli, input_checks
from qerl.errors import UsageError
from qerl.field_rules import PRECISIONS, ROLLOUT_BACKENDS


def build_parser(benchmark: Benchmark, description: str) -> cli.ArgumentParser:
    parser = cli.ArgumentParser(prog=f"python -m eval.{benchmark.name}", description=description)
    parser.add_argument("--model", required=True, help="base model: checkpoint folder (NVFP4 or BF16) or hub id")
    parser.add_argument("--load", choices=PRECISIONS, default="auto", help="precision of the base")
    parser.add_argument(
        "--adapter", help="LoRA adapter folder, a training checkpoint or its final save (default: none, the base alone)"
    )
    names = ", ".join([*benchmark.datasets, *benchmark.builtin])
    parser.add_argument("--data", default=benchmark.default_data, help=f"{names}, or a local .jsonl/.json/.parquet")
    parser.add_argument("--split", help="dataset split (default: a named dataset's own; test for a local file)")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="reference", help="see above")
    parser.add_argument(
        "--format",
        choices=list(benchmark.formats),
        default=next(iter(benchmark.formats)),
        help="how questions are asked and completions scored: the training dataset format",
    )
    budgets = ", ".join(sorted({str(protocol.max_new_tokens) for protocol in PROTOCOLS.values()}))
    parser.add_argument(
        "--max-new-tokens",
        type=cli.COUNT,
        help=f"new tokens per completion at most (default: the protocol's, {budgets})",
    )
    parser.add_argument("--seed", type=cli.SEED, default=0, help="sampling seed (with the batch size and device)")
    parser.add_argument("--limit", type=cli.COUNT, help="evaluate the first N examples only (default: all)")
    parser.add_argument(
        "--batch-size", type=cli.COUNT, default=32, help="transformers backend: prompts per generate call"
    )
    parser.add_argument("--device", help="where the model runs (default: cuda if there is one, else cpu)")
    parser.add_argument(
        "--rollout-backend",
        choices=ROLLOUT_BACKENDS,
        default="auto",
        help="generation engine, as training's; auto: native on a CUDA device (vllm or transformers where it "
        "cannot run the model), transformers on CPU",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=cli.POSITIVE,
        help="native backend: GPU memory for the KV cache (default: 80%% of what is free); more "
        "prompts than fit run in waves",
    )
    parser.add_argument(
        "--out",
        help="per-sample JSONL, its first line the summary "
        f"(default: runs/eval/{benchmark.name}-DATA-PROTOCOL-TIME.jsonl)",
    )
    return parser


def _check_out(path: str) -> None:
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"--out {path}: is a folder; give a file name")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"--out {path}: {parent} is a file, not a folder")


def _check_data(benchmark: Benchmark, data: str) -> None:
    columns = input_checks.check_dataset(data, [*benchmark.datasets, *benchmark.builtin], "--data")
    if data in benchmark.datasets:
        input_checks.check_hub_dataset(benchmark.datasets[data][0], "--data", data, benchmark.local_rows)
    if columns is None:
        return
    questions, gold = benchmark.columns
    if not any(c in columns for c in questions):
        input_checks.require_columns(data, columns, questions[:1], f"eval.{benchmark.name}")
    input_checks.require_columns(data, columns, (gold,), f"eval.{benchmark.name}")


def _warn_eos(model: str) -> None:
    """A tokenizer whose EOS is not among the generation config's EOS ids is said, naming both."""
    if not os.path.isfile(os.path.join(model, "generation_config.json")):
        return
    from transformers import GenerationConfig

    from qerl.base_model import eos_mismatch, load_tokenizer

    mismatch = eos_mismatch(load_tokenizer(model), GenerationConfig.from_pretrained(model))
    if mismatch:
        warnings.warn(f"{model}: {mismatch} (is the tokenizer another model's, or a GGUF's metadata?)", stacklevel=2)


def run(benchmark: Benchmark, argv: list[str], description: str) -> dict:
    """Parse and check the flags and files, generate, score; print and write the results."""
    args = build_parser(benchmark, description).parse_args(argv)
    input_checks.check_model(args.model)
    if args.adapter:
        input_checks.check_adapter(args.adapter, model=args.model)
    _check_data(benchmark, args.data)
    if args.out:
        _check_out(args.out)
    from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint

    if args.load == "bf16" and is_nvfp4_checkpoint(args.model):
        raise UsageError(f"--model {args.model} is an NVFP4 checkpoint; use --load auto or nvfp4")
    if args.device is not None:
        input_checks.check_device(args.device)
    else:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    _warn_eos(args.model)

    rows, score = benchmark.rows(args.data, args.split, benchmark.formats[args.format], args.limit)
    sampling = Sampling.of(PROTOCOLS[args.protocol], args.max_new_tokens, args.seed)
    spec = ModelSpec(
        args.model, args.load, args.adapter, args.device, args.kv_cache_gib, args.rollout_backend, args.batch_size
    )
    samples, scores = score_samples(rows, generate(spec, [r["prompt"] for r in rows], sampling), score)
    n = len(samples)
    summary = {"benchmark": benchmark.name, "data": args.data, "protocol": args.protocol, "format": args.format,
               **asdict(sampling), **asdict(spec), "examples": n, **scores}  # fmt: skip
    out = args.out or os.path.join(
        "runs",
        "eval",
        f"{benchmark.name}-{Path(args.data).stem}-{args.protocol}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl",
    )
    _write_jsonl(out, [summary, *samples])
    if n:
        low, high = summary["accuracy_ci95"]
        print(
            f"eval.{benchmark.name}: accuracy {summary['accuracy']:.1%} (95% CI {low:.1%}-{high:.1%}, n={n}); "
            f"per sample: {out}"
        )
    return summary


def _write_jsonl(path: str, rows: list[dict]) -> None:
    """Written whole or not at all: a temporary file renamed into place."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.partial-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
