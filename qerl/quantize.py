"""Quantize a BF16 Hugging Face causal LM to an NVFP4A16 compressed-tensors checkpoint.

    python -m qerl.quantize --model Qwen/Qwen2.5-7B-Instruct --output ckpt/qwen2.5-7b-nvfp4

Streams the checkpoint one decoder layer at a time (qerl/nvfp4/quantize_checkpoint.py): a 32B model quantizes in
well under 24 GiB of RAM, on the CPU or a GPU (--device cuda), into the bytes and config.json llmcompressor 0.14
writes (its own oneshot as the quantizer: llm-compressor/quantize_nvfp4.py --backend llmcompressor). The output
appears only when complete: the work happens in a hidden sibling folder that is renamed into place at the end.

    python -m qerl.quantize --model ckpt/qwen2.5-coder-1.5b-instruct --output ckpt/qwen15-gptq --device cuda \\
        --gptq-calibration tests/data/gsm8k/train_sample.jsonl

rounds with GPTQ instead of to nearest (qerl/nvfp4/gptq.py): each Linear's rounding error is moved onto the inputs
not yet rounded, so that its outputs on the calibration text change least. The calibration text is the last
--gptq-rows solutions of a GSM8K JSONL (the train split, never the rows a model is scored on: the whole split where
there is one, such as ../shared/data/gsm8k/train.jsonl beside a checkout), each as a chat in the recipes'
gsm8k_hash format. This path holds the whole BF16 model in memory on --device.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from qerl import cli, data, input_checks
from qerl.errors import UsageError
from qerl.field_rules import DTYPES
from qerl.nvfp4 import DEFAULT_IGNORE, DEFAULT_SHARD_BYTES


def build_parser(prog: str = "python -m qerl.quantize", description: str = __doc__) -> cli.ArgumentParser:
    """The quantizer's flags (llm-compressor/quantize_nvfp4.py adds its --backend)."""
    parser = cli.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", required=True, help="BF16 model: local folder or hub id")
    parser.add_argument("--output", required=True, help="folder to write the NVFP4 checkpoint to")
    parser.add_argument("--device", default="cpu", help="where the quantization math runs (cpu, cuda, cuda:1)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype the weights are read in")
    parser.add_argument("--ignore", nargs="*", default=list(DEFAULT_IGNORE), help="Linears kept in BF16")
    parser.add_argument(
        "--max-shard-gb", type=cli.POSITIVE, default=DEFAULT_SHARD_BYTES / 1024**3, help="largest output shard, in GiB"
    )
    parser.add_argument(
        "--gptq-calibration",
        metavar="GSM8K.jsonl",
        help="round with GPTQ, calibrated on this file's reference solutions (default: round to nearest)",
    )
    parser.add_argument("--gptq-rows", type=cli.COUNT, default=128, help="solutions GPTQ calibrates on (the last ones)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace --output if it is an empty folder or a checkpoint this tool wrote (nothing else is replaced)",
    )
    return parser


def check_flags(args) -> None:
    """The flags' checks before anything heavy loads: the model folder, the device, the calibration file."""
    input_checks.check_model(args.model)
    input_checks.check_device(args.device)
    if getattr(args, "gptq_calibration", None):
        calibration_rows(input_checks.check_file(args.gptq_calibration, "--gptq-calibration"), args.gptq_rows)


CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, which no model writes


def gsm8k_solution_ids(tokenizer, row: dict, prompt=data.gsm8k_hash_prompt) -> tuple[list[int], int]:
    """A GSM8K row as a chat: `prompt` of its question, its reference solution (calculator annotations removed)
    as the assistant's turn; returns (token ids, index of the solution's first token)."""
    messages = prompt(row["question"])
    start = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    solution = {"role": "assistant", "content": CALCULATOR.sub("", row["answer"])}
    return tokenizer.apply_chat_template([*messages, solution])["input_ids"], start


def calibration_rows(path: str, count: int) -> list[dict]:
    """The last `count` rows of a GSM8K JSONL; one line names the file and line of a row that is not one."""
    rows = []
    for number, row in input_checks.jsonl_rows(path):
        if not {"question", "answer"} <= row.keys():
            raise UsageError(f"--gptq-calibration {path}, line {number}: lacks 'question' or 'answer'")
        rows.append(row)
    if not rows:
        raise UsageError(f"--gptq-calibration {path}: no rows")
    return rows[-count:]


def gptq_weights(args) -> dict:
    """GPTQ of the model in memory on --device, on the calibration solutions; the quantized weights by name."""
    import torch
    from transformers import AutoModelForCausalLM

    from qerl.base_model import decoder_layers, load_tokenizer
    from qerl.nvfp4.gptq import gptq_model

    tokenizer = load_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch_dtype(args.dtype)).to(args.device).eval()
    rows = calibration_rows(args.gptq_calibration, args.gptq_rows)
    sequences = [torch.tensor([gsm8k_solution_ids(tokenizer, row)[0]], device=args.device) for row in rows]
    return gptq_model(model, decoder_layers(model), sequences, ignore=args.ignore)


def torch_dtype(name: str):
    import torch  # after the flags are read

    return getattr(torch, name)


def quantize_streaming(args) -> Path:
    """The streaming quantizer on parsed flags; returns the output folder."""
    from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint

    return quantize_checkpoint(
        args.model,
        args.output,
        device=args.device,
        dtype=torch_dtype(args.dtype),
        ignore=args.ignore,
        overwrite=args.overwrite,
        max_shard_bytes=int(args.max_shard_gb * 1024**3),
        quantized=gptq_weights(args) if getattr(args, "gptq_calibration", None) else None,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    print(f"qerl.quantize: wrote {quantize_streaming(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "qerl.quantize"))
