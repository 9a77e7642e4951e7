"""NVFP4 checkpoints: our quantizer and loader against compressed-tensors (via transformers) on tiny models."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clis import QUANTIZER, quantize_nvfp4
from reference import reference_compress, reference_global_scale
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    CompressedTensorsConfig,
    Gemma3TextConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from qerl import quantize
from qerl.nvfp4.checkpoint import CheckpointError, is_nvfp4_checkpoint, load_nvfp4_model, save_nvfp4_checkpoint
from qerl.nvfp4.checkpoint.format import INDEX_FILE, tensor_index
from qerl.nvfp4.linear import NVFP4Linear
from qerl.nvfp4.quantize import quantize_model
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint

REPO = Path(__file__).resolve().parents[1]
QUANTIZE = [sys.executable, "-m", "qerl.quantize"]
SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
CONFIGS = {
    "qwen2": lambda: Qwen2Config(**SIZES, tie_word_embeddings=False),  # q/k/v carry biases
    "llama": lambda: LlamaConfig(**SIZES, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**SIZES, head_dim=16, tie_word_embeddings=False),
    # Gemma-3 text: q/k norms, four (1 + w) norms per layer, a scaled embedding tied to the LM head (stays BF16)
    "gemma3": lambda: Gemma3TextConfig(
        **SIZES, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True
    ),
}


def _bf16_model(arch: str, path: Path):
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]()).to(torch.bfloat16)
    with torch.no_grad():  # some spread between q, k and v so that the shared global scale matters
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(3.0)
            layer.mlp.gate_proj.weight.mul_(0.25)
    model.save_pretrained(path)
    return model


def _decompressed_by_compressed_tensors(path: Path):
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    )


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_cli_round_trip_logits_equal_compressed_tensors(seed, tmp_path, arch):
    _bf16_model(arch, tmp_path / "bf16")
    result = subprocess.run(
        [*QUANTIZE, "--model", str(tmp_path / "bf16"), "--output", str(tmp_path / "nvfp4")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    side_files = {p.name for p in (tmp_path / "bf16").iterdir() if p.suffix != ".safetensors"}
    assert side_files <= {p.name for p in (tmp_path / "nvfp4").iterdir()}  # generation_config.json among them
    ours = load_nvfp4_model(tmp_path / "nvfp4", device="cpu")
    assert isinstance(ours.model.layers[0].mlp.down_proj, NVFP4Linear)
    assert type(ours.lm_head) is torch.nn.Linear
    ref = _decompressed_by_compressed_tensors(tmp_path / "nvfp4")
    tokens = torch.randint(0, SIZES["vocab_size"], (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, ref(tokens).logits, rtol=0, atol=0)


def test_native_bytes_match_compressed_tensors_compressor(seed, tmp_path):
    bf16 = _bf16_model("qwen2", tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "nvfp4")
    written = load_file(tmp_path / "nvfp4" / "model.safetensors")
    for layer in bf16.model.layers:
        for group in (
            (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            (layer.mlp.gate_proj, layer.mlp.up_proj),
            (layer.self_attn.o_proj,),
            (layer.mlp.down_proj,),
        ):
            gs = reference_global_scale(*(m.weight for m in group))
            for module in group:
                name = next(n for n, m in bf16.named_modules() if m is module)
                ref = reference_compress(module.weight.detach(), gs)
                assert torch.equal(written[f"{name}.weight_packed"], ref["weight_packed"]), name
                assert torch.equal(
                    written[f"{name}.weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8)
                )
                assert torch.equal(written[f"{name}.weight_global_scale"], gs.float().reshape(1))
    assert torch.equal(written["model.embed_tokens.weight"], bf16.model.embed_tokens.weight)
    assert "lm_head.weight" in written and "lm_head.weight_packed" not in written
    config = json.loads((tmp_path / "nvfp4" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized" and config["quant_method"] == "compressed-tensors"
    assert config["ignore"] == ["lm_head"] and config["quantization_status"] == "compressed"


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


def test_sharded_checkpoint_loads_and_missing_shard_is_named(seed, tmp_path):
    _bf16_model("qwen2", tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "nvfp4", max_shard_bytes=8 * 1024)
    shards = sorted((tmp_path / "nvfp4").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "nvfp4" / INDEX_FILE).is_file()
    index = tensor_index(tmp_path / "nvfp4")
    for name, shard in index.items():
        with safe_open(shard, "pt") as f:
            assert name in f.keys()
    model = load_nvfp4_model(tmp_path / "nvfp4", device="cpu")
    ref = _decompressed_by_compressed_tensors(tmp_path / "nvfp4")
    tokens = torch.randint(0, SIZES["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=shards[1].name):
        load_nvfp4_model(tmp_path / "nvfp4", device="cpu")


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


def test_cli_reports_bad_input_without_traceback(tmp_path):
    config = Qwen2Config(**{**SIZES, "hidden_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2})
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "odd")
    result = subprocess.run(
        [*QUANTIZE, "--model", str(tmp_path / "odd"), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "in_features=40 is not divisible" in result.stderr and "Traceback" not in result.stderr
    assert re.search(r"model\.layers\.0\.(self_attn|mlp)\.\w+_proj\.weight \(model\.safetensors\)", result.stderr)
    assert not (tmp_path / "out").exists()


def test_llmcompressor_script_native_backend_is_the_package_quantizer(seed, tmp_path):
    """llm-compressor/quantize_nvfp4.py's default backend writes what `python -m qerl.quantize` writes."""
    _bf16_model("qwen2", tmp_path / "bf16")
    for main, out in ((quantize.main, "package"), (quantize_nvfp4.main, "script")):
        assert main(["--model", str(tmp_path / "bf16"), "--output", str(tmp_path / out)]) == 0
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "package" / name).read_bytes() == (tmp_path / "script" / name).read_bytes()


def test_llmcompressor_backend_writes_the_same_bytes(seed, tmp_path):
    pytest.importorskip("llmcompressor", reason="the llmcompressor backend is optional (pip install -e .[quantize])")
    _bf16_model("qwen2", tmp_path / "bf16")
    for backend in ("native", "llmcompressor"):
        result = subprocess.run(
            [
                sys.executable,
                str(QUANTIZER),
                "--model",
                str(tmp_path / "bf16"),
                "--output",
                str(tmp_path / backend),
                "--backend",
                backend,
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert result.returncode == 0, result.stderr
    configs = [json.loads((tmp_path / b / "config.json").read_text()) for b in ("native", "llmcompressor")]
    assert configs[0]["quantization_config"] == configs[1]["quantization_config"]
    native = load_file(tmp_path / "native" / "model.safetensors")
    theirs = load_file(tmp_path / "llmcompressor" / "model.safetensors")
    assert native.keys() == theirs.keys()
    for key in native:
        assert torch.equal(native[key].view(torch.uint8), theirs[key].view(torch.uint8)), key
