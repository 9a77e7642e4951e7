"""What an NVFP4A16 compressed-tensors checkpoint folder is, and the one check that a folder is one.

A transformers model folder whose config.json carries the quantization_config that llmcompressor writes
(`quantization_config()` below, field for field), and whose safetensors hold, for each quantized Linear,
`weight_packed`, `weight_scale` and `weight_global_scale` instead of `weight`, in one `model.safetensors` or
in shards listed by `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from qerl.errors import UsageError
from qerl.nvfp4 import DEFAULT_IGNORE, codec
from qerl.sniff import check_safetensors, looks_like_path

FORMAT = "nvfp4-pack-quantized"
QUANT_METHOD = "compressed-tensors"
COMPRESSED_TENSORS_VERSION = "0.19.0"  # the version llmcompressor 0.14 pins and writes
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(UsageError):
    """A checkpoint folder that cannot be read or written as asked; the message names the file or tensor at fault."""


def quantization_config(ignore=DEFAULT_IGNORE) -> dict:
    """config.json's quantization_config for NVFP4A16, field for field as llmcompressor 0.14 writes it."""
    return {
        "config_groups": {
            "group_0": {
                "format": FORMAT,
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": codec.GROUP_SIZE,
                    "num_bits": 4,
                    "observer": "memoryless_minmax",
                    "observer_kwargs": {},
                    "scale_dtype": "torch.float8_e4m3fn",
                    "strategy": "tensor_group",
                    "symmetric": True,
                    "type": "float",
                    "zp_dtype": None,
                },
            }
        },
        "format": FORMAT,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def check_quantization_config(config: dict, config_path: Path) -> dict:
    """Return the quantization_config of an NVFP4A16 checkpoint, or raise naming what it is instead."""
    qcfg = config.get("quantization_config")
    if qcfg is None:
        raise CheckpointError(
            f"{config_path}: no quantization_config, so this is not a quantized checkpoint. Load it as BF16, "
            "or quantize it first: python -m qerl.quantize --model DIR --output OUT"
        )
    method = qcfg.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(f"{config_path}: quant_method is {method!r}; only {QUANT_METHOD!r} NVFP4 is supported")
    fmt = qcfg.get("format")
    for group_name, group in qcfg.get("config_groups", {}).items():
        weights = group.get("weights") or {}
        if group.get("input_activations"):
            raise CheckpointError(f"{config_path}: config group {group_name!r} quantizes activations; we read W4A16")
        spec = (weights.get("num_bits"), weights.get("type"), weights.get("group_size"))
        group_format = group.get("format") or fmt
        if spec != (4, "float", codec.GROUP_SIZE) or group_format != FORMAT:
            raise CheckpointError(
                f"{config_path}: config group {group_name!r} is {group_format} with num_bits={spec[0]}, "
                f"type={spec[1]}, group_size={spec[2]}; expected {FORMAT} (NVFP4A16: 4-bit float, groups of 16)"
            )
    if fmt != FORMAT and fmt != "mixed-precision":
        raise CheckpointError(f"{config_path}: format is {fmt!r}, expected {FORMAT!r}")
    if qcfg.get("quantization_status") != "compressed":
        raise CheckpointError(
            f"{config_path}: quantization_status is {qcfg.get('quantization_status')!r}, expected 'compressed'"
        )
    return qcfg


def is_nvfp4_checkpoint(name_or_path: str | os.PathLike) -> bool:
    """Whether a local folder is an NVFP4A16 checkpoint, by check_quantization_config: False for a folder without a
    quantization_config (BF16) and for a hub id (not looked up); a folder quantized some other way raises that
    check's CheckpointError, which names what it is."""
    config_path = Path(name_or_path) / "config.json"
    if not config_path.is_file():
        return False
    config = read_config(config_path.parent)
    if config.get("quantization_config") is None:
        return False
    check_quantization_config(config, config_path)
    return True


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id, fetched (or found in the cache) through huggingface_hub."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path}: expected a model folder, found a file")
    if looks_like_path(str(name_or_path)):
        raise CheckpointError(f"{path}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(name_or_path), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
            )
        )
    except Exception as err:  # offline, unknown id, gated repo: say which, keep the cause
        raise CheckpointError(f"{name_or_path}: not a local folder and not downloadable from the hub ({err})") from err


def read_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing; a model folder needs its config.json")
    with open(config_path) as f:
        return json.load(f)


def tensor_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single-file or sharded folder; every shard must exist."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        shards = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(shards.values())):
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {index_path} is missing")
            check_safetensors(shard)
        return shards
    single = model_dir / SINGLE_FILE
    if single.is_file():
        check_safetensors(single)
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in model_dir.glob("*.bin")) or sorted(p.name for p in model_dir.iterdir())
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (found: {', '.join(found) or 'nothing'})")


def logical_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape as the model holds it, from the safetensors headers alone (no tensor is read): a packed
    NVFP4 Linear counts as its `weight`, [out_features, in_features]."""
    shapes = {}
    for shard in sorted(set(tensor_index(model_dir).values())):
        for name, info in check_safetensors(shard).items():
            module, _, kind = name.rpartition(".")
            if kind == "weight_packed":  # two FP4 values per byte
                shapes[f"{module}.weight"] = (info["shape"][0], 2 * info["shape"][1])
            elif kind not in ("weight_scale", "weight_global_scale"):
                shapes[name] = tuple(info["shape"])
    return shapes


def check_finite(name: str, tensor: torch.Tensor, shard: Path) -> None:
    if tensor.is_floating_point():
        values = tensor.float() if tensor.element_size() == 1 else tensor  # isfinite has no FP8 kernels
        if not torch.isfinite(values).all():
            raise CheckpointError(f"{shard}: tensor {name} contains NaN or Inf")
