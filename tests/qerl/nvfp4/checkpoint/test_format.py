"""What an NVFP4 checkpoint is (qerl/nvfp4/checkpoint/format.py): the quantization_config written parses as
compressed-tensors' NVFP4A16, and folders in other formats are refused by name."""

import json

import pytest
from checkpoint_models import _bf16_model

from qerl.nvfp4.checkpoint import CheckpointError, is_nvfp4_checkpoint, load_nvfp4_model
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint


def test_config_parses_as_compressed_tensors_nvfp4a16(seed, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    _bf16_model("llama", tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "nvfp4")
    ours = QuantizationConfig.model_validate(
        json.loads((tmp_path / "nvfp4" / "config.json").read_text())["quantization_config"]
    )
    preset = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    weights = ours.config_groups["group_0"].weights
    for field in ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "scale_dtype"):
        assert getattr(weights, field) == getattr(preset, field), field


@pytest.mark.parametrize(
    "qcfg, message",
    [
        (None, "not a quantized checkpoint"),
        ({"quant_method": "awq", "bits": 4}, "quant_method is 'awq'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method is 'fp8'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}},
            },
            "int",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "group_size": None}}},
            },
            "num_bits=8",
        ),
    ],
)
def test_other_formats_are_refused_by_name(seed, tmp_path, qcfg, message):
    _bf16_model("llama", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    if qcfg is not None:
        config["quantization_config"] = qcfg
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as info:
        load_nvfp4_model(tmp_path / "m", device="cpu")
    assert "config.json" in str(info.value)
    # The one check, as a question: a BF16 folder is not NVFP4; a folder quantized otherwise is named the same way.
    if qcfg is None:
        assert not is_nvfp4_checkpoint(tmp_path / "m")
    else:
        with pytest.raises(CheckpointError, match=message):
            is_nvfp4_checkpoint(tmp_path / "m")
