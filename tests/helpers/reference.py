"""compressed-tensors as the trusted reference: its own qparam math and NVFP4 compressor, nothing of ours."""

from __future__ import annotations

import pytest
import torch

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is the reference (pip install -e .[dev])")

from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402


def nvfp4a16_scheme(targets=("Linear",)) -> QuantizationScheme:
    return preset_name_to_scheme("NVFP4A16", list(targets))


def reference_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """What llmcompressor's min-max observer gives a (possibly fused) group: one amax over all members."""
    mins = torch.stack([w.amin() for w in weights]).amin()
    maxs = torch.stack([w.amax() for w in weights]).amax()
    return generate_gparam(mins, maxs)


def reference_compress(weight: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """compressed-tensors' compressor on llmcompressor-style per-group min/max qparams."""
    scheme = nvfp4a16_scheme()
    if global_scale is None:
        global_scale = reference_global_scale(weight)
    groups = weight.reshape(weight.shape[0], -1, scheme.weights.group_size)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": weight, "weight_scale": scale, "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.compress(state, scheme)


def reference_decompress(packed, scale, global_scale) -> torch.Tensor:
    state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": global_scale}
    return NVFP4PackedCompressor.decompress(state, nvfp4a16_scheme())["weight"]
