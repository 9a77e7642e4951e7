"""Quantize a BF16 Hugging Face causal LM to an NVFP4A16 compressed-tensors checkpoint.

    python -m qerl.quantize --model Qwen/Qwen2.5-7B-Instruct --output ckpt/qwen2.5-7b-nvfp4

Streams the checkpoint one decoder layer at a time (qerl/nvfp4/quantize_checkpoint.py): a 32B model quantizes in
well under 24 GiB of RAM, on the CPU or a GPU (--device cuda), into the bytes and config.json llmcompressor 0.14
writes (its own oneshot as the quantizer: llm-compressor/quantize_nvfp4.py --backend llmcompressor). The output
appears only when complete: the work happens in a hidden sibling folder that is renamed into place at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qerl import cli, input_checks
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
        "--overwrite",
        action="store_true",
        help="replace --output if it is an empty folder or a checkpoint this tool wrote (nothing else is replaced)",
    )
    return parser


def check_flags(args) -> None:
    """The flags' checks before anything heavy loads: the model folder and the device."""
    input_checks.check_model(args.model)
    input_checks.check_device(args.device)


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
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    print(f"qerl.quantize: wrote {quantize_streaming(args)}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "qerl.quantize"))
