"""Quantizing a BF16 checkpoint folder (qerl/nvfp4/quantize_checkpoint.py): the bytes it writes are
compressed-tensors' own compressor's."""

import json

import torch
from checkpoint_models import _bf16_model
from reference import reference_compress, reference_global_scale
from safetensors.torch import load_file

from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint


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
