"""An NVFP4A16 checkpoint folder -> a transformers causal LM whose quantized Linears are NVFP4Linear.

The architecture is built on the meta device, the quantized Linears are swapped for NVFP4Linear, then each
shard's tensors go straight to the target device: the weights are never expanded to BF16, so peak memory stays
close to the packed size.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from qerl.nvfp4.checkpoint.format import (
    CheckpointError,
    check_finite,
    check_quantization_config,
    read_config,
    resolve_model_dir,
    tensor_index,
)
from qerl.nvfp4.linear import NVFP4Linear

_PACKED_SUFFIX = ".weight_packed"


def meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The architecture with its parameters on the meta device; real (small) buffers such as rotary tables.

    Built as transformers builds its own quantized models: on the meta device and outside DeepSpeed's zero.Init,
    which transformers otherwise enters whenever a ZeRO-3 config is registered (accelerate registers one even with
    zero3_init_flag false) and which cannot take meta tensors. ZeRO-3 partitions the loaded model's parameters
    when the trainer prepares it; the packed weights are buffers, which it leaves whole.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import set_quantized_state

    with init_empty_weights(include_buffers=False), set_quantized_state():
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _swap_in_nvfp4_linears(model: nn.Module, index: dict[str, Path], dtype: torch.dtype) -> None:
    """Replace every Linear that the checkpoint holds packed with an NVFP4Linear (on meta, filled by the load)."""
    for packed_name in (n for n in index if n.endswith(_PACKED_SUFFIX)):
        module_name = packed_name[: -len(_PACKED_SUFFIX)]
        try:
            old = model.get_submodule(module_name)
        except AttributeError:
            raise CheckpointError(f"{packed_name}: no module {module_name!r} in {type(model).__name__}") from None
        if not isinstance(old, nn.Linear):
            raise CheckpointError(f"{packed_name}: {module_name!r} is a {type(old).__name__}, not a Linear")
        parent_name, _, child = module_name.rpartition(".")
        new = NVFP4Linear(old.in_features, old.out_features, old.bias is not None, "meta", dtype)
        setattr(model.get_submodule(parent_name), child, new)


def _read_shard(shard: Path, names: list[str], expected: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """The shard's tensors on `device`, checked against the model and cast to its floating dtype."""
    tensors = {}
    with safe_open(shard, "pt", device="cpu") as f:
        for name in names:
            value = f.get_tensor(name)
            check_finite(name, value, shard)
            want = expected[name]
            if value.shape != want.shape:
                raise CheckpointError(
                    f"{shard}: {name} has shape {tuple(value.shape)}, the model expects {tuple(want.shape)}"
                )
            if want.is_floating_point() and want.dtype in (torch.float32, torch.bfloat16, torch.float16):
                value = value.to(want.dtype)
            elif value.dtype != want.dtype:
                raise CheckpointError(f"{shard}: {name} is {value.dtype}, expected {want.dtype}")
            tensors[name] = value.to(device)  # one tensor at a time in host memory
    return tensors


def load_nvfp4_model(
    name_or_path: str | os.PathLike,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """Load an NVFP4A16 checkpoint onto `device` (default: cuda if available), compute dtype `dtype`."""
    from transformers import AutoConfig, GenerationConfig

    model_dir = resolve_model_dir(name_or_path)
    check_quantization_config(read_config(model_dir), model_dir / "config.json")
    index = tensor_index(model_dir)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    model = meta_model(AutoConfig.from_pretrained(model_dir), dtype)
    if (model_dir / "generation_config.json").is_file():  # stop tokens and sampling defaults, as for a BF16 load
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    _swap_in_nvfp4_linears(model, index, dtype)

    expected = dict(model.state_dict(keep_vars=True))
    by_shard: dict[Path, list[str]] = defaultdict(list)
    for name, shard in index.items():
        if name not in expected:
            raise CheckpointError(f"{shard}: tensor {name!r} matches nothing in {type(model).__name__}")
        by_shard[shard].append(name)
    for shard, names in tqdm(sorted(by_shard.items()), desc=f"Loading {model_dir.name}", unit="shard"):
        # assign: the meta tensors are replaced by the loaded ones (nothing to copy into)
        model.load_state_dict(_read_shard(shard, names, expected, device), strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if missing:
        raise CheckpointError(
            f"{model_dir}: tensors missing from the checkpoint: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            module.process_weights_after_loading()
    model.to(device)  # the buffers that were built rather than loaded (rotary tables)
    model.eval()
    return model
