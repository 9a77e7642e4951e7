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

import argparse
import sys
from pathlib import Path

import torch

from qerl.nvfp4.checkpoint import (
    DEFAULT_SHARD_BYTES,
    CheckpointError,
    _AtomicOutputDir,
    quantize_checkpoint,
    resolve_model_dir,
)
from qerl.nvfp4.quantize import DEFAULT_IGNORE

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def quantize_with_llmcompressor(model: str, output: str, device: str, dtype: torch.dtype, ignore, overwrite: bool):
    try:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError as err:
        raise SystemExit(f"--backend llmcompressor needs llmcompressor: pip install -e .[quantize] ({err})") from err
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model_dir(model)
    with _AtomicOutputDir(output, overwrite) as tmp:
        hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, device_map=device)
        recipe = QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=list(ignore))
        oneshot(model=hf_model, recipe=recipe)
        hf_model.save_pretrained(tmp, save_compressed=True)
        try:
            AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
        except (OSError, ValueError):
            pass  # a model folder without a tokenizer stays without one
    return Path(output).resolve()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="BF16 model: local folder or hub id")
    parser.add_argument("--output", required=True, help="folder to write the NVFP4 checkpoint to")
    parser.add_argument("--backend", choices=("native", "llmcompressor"), default="native")
    parser.add_argument("--device", default="cpu", help="where the quantization math runs (cpu, cuda, cuda:1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype the weights are read in")
    parser.add_argument("--ignore", nargs="*", default=list(DEFAULT_IGNORE), help="Linears kept in BF16")
    parser.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_BYTES / 1024**3)
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    args = parser.parse_args(argv)

    try:
        if args.backend == "native":
            out = quantize_checkpoint(
                args.model,
                args.output,
                device=args.device,
                dtype=DTYPES[args.dtype],
                ignore=args.ignore,
                overwrite=args.overwrite,
                max_shard_bytes=int(args.max_shard_gb * 1024**3),
            )
        else:
            out = quantize_with_llmcompressor(
                args.model, args.output, args.device, DTYPES[args.dtype], args.ignore, args.overwrite
            )
    except (CheckpointError, FileExistsError, ValueError) as err:
        print(f"quantize_nvfp4: error: {err}", file=sys.stderr)
        return 2
    print(f"quantize_nvfp4: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
