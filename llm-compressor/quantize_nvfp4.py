"""Quantize a BF16 Hugging Face causal LM to an NVFP4A16 compressed-tensors checkpoint.

    python llm-compressor/quantize_nvfp4.py --model Qwen/Qwen2.5-7B-Instruct --output ckpt/qwen2.5-7b-nvfp4

Backends write the same bytes:
  native         (default) streams the checkpoint one decoder layer at a time: a 32B model quantizes in
                 well under 24 GiB of RAM, on the CPU or a GPU (--device cuda).
  llmcompressor  llmcompressor's oneshot with the NVFP4A16 scheme (pip install -e .[quantize]); loads the
                 whole model.
Either way the output appears only when complete: the work happens in a hidden sibling folder that is
renamed into place at the end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Run as a script, this file's folder (not the repository) is on sys.path: make the checkout's qerl the one imported.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from qerl import cli, input_checks  # noqa: E402
from qerl.errors import UsageError  # noqa: E402
from qerl.nvfp4.checkpoint import quantize_checkpoint  # noqa: E402
from qerl.nvfp4.checkpoint.format import resolve_model_dir  # noqa: E402
from qerl.nvfp4.checkpoint.write import DEFAULT_SHARD_BYTES, AtomicOutputDir, copy_side_files  # noqa: E402
from qerl.nvfp4.quantize import DEFAULT_IGNORE  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def quantize_with_llmcompressor(model: str, output: str, device: str, dtype, ignore, overwrite: bool) -> Path:
    try:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError as err:
        raise UsageError(
            f"--backend llmcompressor needs llmcompressor (pip install -e .[quantize]): {err}"
        ) from err
    from transformers import AutoModelForCausalLM

    src = resolve_model_dir(model)
    with AtomicOutputDir(output, overwrite, source=src) as tmp:
        hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, device_map=device)
        recipe = QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=list(ignore))
        oneshot(model=hf_model, recipe=recipe)
        hf_model.save_pretrained(tmp, save_compressed=True)
        copy_side_files(src, tmp)
    return Path(output).resolve()


def build_parser() -> cli.ArgumentParser:
    parser = cli.ArgumentParser(prog="quantize_nvfp4.py", description=__doc__)
    parser.add_argument("--model", required=True, help="BF16 model: local folder or hub id")
    parser.add_argument("--output", required=True, help="folder to write the NVFP4 checkpoint to")
    parser.add_argument("--backend", choices=("native", "llmcompressor"), default="native", help="see above")
    parser.add_argument("--device", default="cpu", help="where the quantization math runs (cpu, cuda, cuda:1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype the weights are read in")
    parser.add_argument("--ignore", nargs="*", default=list(DEFAULT_IGNORE), help="Linears kept in BF16")
    parser.add_argument("--max-shard-gb", type=cli.POSITIVE, default=DEFAULT_SHARD_BYTES / 1024**3,
                        help="largest output shard, in GiB")  # fmt: skip
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace --output if it is an empty folder or a checkpoint this tool wrote (nothing else is replaced)",
    )  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    input_checks.check_model(args.model)
    input_checks.check_device(args.device)

    dtype = DTYPES[args.dtype]
    if args.backend == "native":
        out = quantize_checkpoint(
            args.model,
            args.output,
            device=args.device,
            dtype=dtype,
            ignore=args.ignore,
            overwrite=args.overwrite,
            max_shard_bytes=int(args.max_shard_gb * 1024**3),
        )
    else:
        out = quantize_with_llmcompressor(args.model, args.output, args.device, dtype, args.ignore, args.overwrite)
    print(f"quantize_nvfp4: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "quantize_nvfp4"))
