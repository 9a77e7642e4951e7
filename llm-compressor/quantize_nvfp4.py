"""Quantize a BF16 Hugging Face causal LM to an NVFP4A16 compressed-tensors checkpoint, with llmcompressor's oneshot
as a second backend.

    python llm-compressor/quantize_nvfp4.py --backend llmcompressor --model Qwen/Qwen2.5-7B-Instruct --output OUT

This script is here for the llmcompressor backend (in the folder named after the library, where the QeRL reference
keeps its quantizer); the default one is the package's `python -m qerl.quantize`, whose flags it takes too.
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

from qerl import cli, quantize  # noqa: E402
from qerl.errors import UsageError  # noqa: E402


def quantize_with_llmcompressor(model: str, output: str, device: str, dtype, ignore, overwrite: bool) -> Path:
    try:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier
    except ImportError as err:
        raise UsageError(f"--backend llmcompressor needs llmcompressor (pip install -e .[quantize]): {err}") from err
    from transformers import AutoModelForCausalLM

    from qerl.nvfp4.checkpoint.format import resolve_model_dir
    from qerl.nvfp4.checkpoint.write import AtomicOutputDir, copy_side_files

    src = resolve_model_dir(model)
    with AtomicOutputDir(output, overwrite, source=src) as tmp:
        hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, device_map=device)
        recipe = QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=list(ignore))
        oneshot(model=hf_model, recipe=recipe)
        hf_model.save_pretrained(tmp, save_compressed=True)
        copy_side_files(src, tmp)
    return Path(output).resolve()


def build_parser() -> cli.ArgumentParser:
    parser = quantize.build_parser(prog="quantize_nvfp4.py", description=__doc__)
    parser.add_argument("--backend", choices=("native", "llmcompressor"), default="native", help="see above")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quantize.check_flags(args)
    if args.backend == "native":
        out = quantize.quantize_streaming(args)
    else:
        dtype = quantize.torch_dtype(args.dtype)
        out = quantize_with_llmcompressor(args.model, args.output, args.device, dtype, args.ignore, args.overwrite)
    print(f"quantize_nvfp4: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "quantize_nvfp4"))
