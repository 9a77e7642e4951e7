"""Writing an NVFP4 checkpoint (qerl/nvfp4/checkpoint/write.py): a model saved from memory equals the streaming
quantizer's folder and names its causal-LM class; the output folder is refused unless --overwrite, and appears only
once complete."""

import json

import pytest
import torch
from checkpoint_models import SIZES, _bf16_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen3Config

from qerl.nvfp4.checkpoint import CheckpointError, save_nvfp4_checkpoint
from qerl.nvfp4.quantize import quantize_model
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint


def test_in_memory_save_equals_streaming_quantizer(seed, tmp_path):
    bf16 = _bf16_model("qwen2", tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "streamed")
    save_nvfp4_checkpoint(quantize_model(bf16), tmp_path / "in_memory")
    a, b = (
        load_file(tmp_path / "streamed" / "model.safetensors"),
        load_file(tmp_path / "in_memory" / "model.safetensors"),
    )
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


def test_output_folder_is_refused_unless_overwrite(seed, tmp_path):
    _bf16_model("llama", tmp_path / "bf16")
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="--overwrite"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "out")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_failed_run_leaves_no_checkpoint_behind(seed, tmp_path):
    _bf16_model("qwen2", tmp_path / "bf16")
    weights = load_file(tmp_path / "bf16" / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")  # the last layer fails, after the first
    save_file(weights, tmp_path / "bf16" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*NaN"):
        quantize_checkpoint(tmp_path / "bf16", tmp_path / "nvfp4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16"]


TINY = {**SIZES, "head_dim": 16}


@pytest.mark.parametrize(
    "config, architecture",
    [
        (lambda: Gemma3TextConfig(**TINY, query_pre_attn_scalar=16, sliding_window=8), "Gemma3ForCausalLM"),
        (lambda: Qwen3Config(**TINY, tie_word_embeddings=False), "Qwen3ForCausalLM"),
    ],
    ids=["gemma3", "qwen3"],
)
def test_nvfp4_checkpoint_of_a_model_built_in_memory_names_its_causal_lm(tmp_path, config, architecture):
    """A model built from a config (benchmarks.random_models) has no config.architectures; the NVFP4 writer records the
    model's class as save_pretrained does. Without it vLLM takes the model type's base class (Gemma3TextModel,
    Qwen3Model), which it serves as an embedding model."""
    model = AutoModelForCausalLM.from_config(config())
    assert not model.config.architectures
    folder = save_nvfp4_checkpoint(quantize_model(model), tmp_path / "nvfp4")
    written = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == [architecture]
    assert written["model_type"] == model.config.model_type and "quantization_config" in written
