"""The streaming quantizer: a BF16 (or FP16/FP32) checkpoint folder -> an NVFP4A16 folder, one decoder layer at
a time, so that no more than a layer is ever in memory (`python -m qerl.quantize`). Which Linears it quantizes and
which share a global scale: quantize.py, whose rules the in-memory quantizer there applies too."""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from qerl.nvfp4 import DEFAULT_IGNORE, DEFAULT_SHARD_BYTES, codec
from qerl.nvfp4.checkpoint.format import CheckpointError, check_finite, read_config, resolve_model_dir, tensor_index
from qerl.nvfp4.checkpoint.load import meta_model
from qerl.nvfp4.checkpoint.write import AtomicOutputDir, ShardWriter, copy_side_files, write_config
from qerl.nvfp4.quantize import global_scales, quantization_targets

_LAYER_PREFIX = re.compile(r"^(.*\.layers\.\d+)\.")


def _read_tensors(index: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Read `names` from their shards, opening each only for this read: a shard left open stays mapped,
    and its pages would count against the memory we promise to stay within."""
    tensors = {}
    with ExitStack() as stack:
        handles = {
            shard: stack.enter_context(safe_open(shard, "pt", device="cpu")) for shard in {index[n] for n in names}
        }
        for name in names:
            tensors[name] = handles[index[name]].get_tensor(name)
    return tensors


def _return_freed_memory() -> None:
    """Hand freed heap memory back to the OS between layers. glibc keeps freed blocks of a few tens of MB
    in its heap (its mmap threshold rises after the first large free), so without this the resident size
    of a layer-by-layer loop creeps up by about a layer each step."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # another C library (musl): nothing to trim
            pass


def _group_by_layer(names) -> list[list[str]]:
    """Tensor names grouped by decoder layer (fused siblings always share one), other tensors last."""
    layers: dict[str, list[str]] = defaultdict(list)
    rest: list[str] = []
    for name in names:
        match = _LAYER_PREFIX.match(name)
        (layers[match.group(1)] if match else rest).append(name)
    ordered = sorted(layers, key=lambda p: [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", p)])
    return [layers[p] for p in ordered] + ([rest] if rest else [])


@torch.no_grad()
def quantize_checkpoint(
    model: str | os.PathLike,
    output: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    ignore=DEFAULT_IGNORE,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    quantized: dict[str, codec.NVFP4Weight] | None = None,
) -> Path:
    """Quantize a BF16 (or FP16/FP32) checkpoint folder to NVFP4A16, one decoder layer at a time.

    Memory: one layer's weights plus one output shard, whatever the model size. Which Linears are
    quantized comes from the architecture (every nn.Linear but `ignore`), as in llmcompressor's recipe.
    `quantized`: every one of them already quantized (GPTQ: gptq.py), by module name, written instead of
    rounding to nearest; their global scales must be the ones the fused-group rule gives.
    """
    from transformers import AutoConfig

    src = resolve_model_dir(model)
    config = read_config(src)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise CheckpointError(f"{src / 'config.json'}: already quantized ({method}); give a BF16 checkpoint")
    output_dir = AtomicOutputDir(output, overwrite, source=src)
    index = tensor_index(src)
    meta = meta_model(AutoConfig.from_pretrained(src), dtype)
    targets = {f"{name}.weight" for name in quantization_targets(meta, ignore)}
    if quantized is not None and {f"{name}.weight" for name in quantized} != targets:
        raise CheckpointError(f"{src}: the quantized weights given are not the {len(targets)} Linears to quantize")
    absent = sorted(targets - index.keys())
    if absent:
        raise CheckpointError(f"{src}: checkpoint lacks Linear weights the architecture has: {', '.join(absent[:8])}")
    for name in sorted(targets):  # before any work: the shapes come from the config
        in_features = meta.get_submodule(name[: -len(".weight")]).in_features
        if in_features % codec.GROUP_SIZE:
            raise CheckpointError(
                f"{name} ({index[name].name}): in_features={in_features} is not divisible by the NVFP4 group size "
                f"{codec.GROUP_SIZE}; keep this Linear in BF16 with --ignore"
            )

    with output_dir as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for names in tqdm(_group_by_layer(index), desc=f"Quantizing {src.name}", unit="layer"):
            _return_freed_memory()
            tensors = _read_tensors(index, names)
            for name, tensor in tensors.items():
                check_finite(name, tensor, index[name])
                if tensor.is_floating_point() and name not in targets:
                    writer.add(name, tensor.to(dtype))
                elif name not in targets:
                    writer.add(name, tensor)
            weights = {n[: -len(".weight")]: tensors[n].to(device=device, dtype=dtype) for n in names if n in targets}
            for module_name, scale in global_scales(weights).items():
                label = f"{module_name}.weight ({index[module_name + '.weight'].name})"
                q = (
                    codec.quantize(weights[module_name], scale, name=label)
                    if quantized is None
                    else quantized[module_name]
                )
                if not torch.equal(q.global_scale.cpu(), scale.cpu()):
                    raise CheckpointError(f"{label}: the given quantization's global scale is not its fused group's")
                writer.add(f"{module_name}.weight_packed", q.packed)
                writer.add(f"{module_name}.weight_scale", q.scale)
                writer.add(f"{module_name}.weight_global_scale", q.global_scale.clone())  # fused siblings share one
        writer.finish()
        write_config(config, tmp, ignore)
        copy_side_files(src, tmp)
    return Path(output).resolve()
