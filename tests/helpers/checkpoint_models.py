"""Tiny BF16 models of four architectures saved as checkpoints, and compressed-tensors' own decompression of an NVFP4
folder: what the checkpoint tests share (tests/qerl/test_quantize.py, tests/qerl/nvfp4/test_quantize_checkpoint.py,
tests/qerl/nvfp4/checkpoint/, tests/tools/llm_compressor/test_quantize_nvfp4.py)."""

import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    CompressedTensorsConfig,
    Gemma3TextConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

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
