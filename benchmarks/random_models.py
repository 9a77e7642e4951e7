"""Random-weight models of real shapes for the GPU benchmarks: Qwen2.5 1.5B-32B, Llama-3.1-8B, Qwen3-8B and Gemma-3-4B
configs, built on the GPU (NVFP4: quantized one decoder layer at a time, so a 32B model never exists in BF16), the
character tokenizer padded to their vocabulary, and a rank-16 LoRA with random B on every projection.

Used by benchmarks.rollout, benchmarks.step, benchmarks.probes.step_costs and benchmarks.multi_gpu.
"""

from __future__ import annotations

# torch, transformers and the model code are imported where a model is built: the tools' --help lists SIZES.

# (hidden, intermediate, layers, heads, kv heads, vocab) of Qwen2.5-{0.5,1.5,3,7,14,32}B; Llama-3.1-8B as the
# architecture the native engine was not tuned on (no q/k/v bias, llama3 RoPE scaling, 128K context).
QWEN25 = {
    "0.5b": (896, 4864, 24, 14, 2, 151936),  # head_dim 64, tied embeddings
    "1.5b": (1536, 8960, 28, 12, 2, 151936),  # untied, as the Q4_K_M GGUF of Qwen2.5-Coder-1.5B-Instruct converts
    "3b": (2048, 11008, 36, 16, 2, 151936),
    "7b": (3584, 18944, 28, 28, 4, 152064),
    "14b": (5120, 13824, 48, 40, 8, 152064),
    "32b": (5120, 27648, 64, 40, 8, 152064),
}
TIED = {"0.5b"}  # Qwen2.5-0.5B shares its embedding with the LM head
SIZES = [*QWEN25, "llama8b", "qwen3-8b", "gemma3-4b"]


def model_config(size: str):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    if size == "qwen3-8b":  # Qwen/Qwen3-8B: per-head q/k norms, head_dim 128, no biases
        return Qwen3Config(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    if size == "gemma3-4b":
        # google/gemma-3-4b-it's text model. Shapes, window, pattern (5 local : 1 global), query_pre_attn_scalar and
        # the global layers' linear rope scaling: AI-Hypercomputer/maxtext's ckpt_conversion hf_model_configs.py;
        # vocab 262208, rope bases 1e4 local / 1e6 global, 131072 positions: transformers' Gemma3TextConfig
        # defaults, which document that checkpoint.
        return Gemma3TextConfig(
            vocab_size=262208,
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            sliding_window_pattern=6,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        )
    if size == "llama8b":
        return LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    hidden, inter, layers, heads, kv, vocab = QWEN25[size]
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=32768,
        tie_word_embeddings=size in TIED,
    )


def build(size: str, precision: str = "bf16", device="cuda"):
    """Random-weight model in BF16, or NVFP4 quantized one decoder layer at a time (peak: one BF16 layer)."""
    import torch

    with torch.no_grad():
        return _random_model(size, precision, device)


def _random_model(size: str, precision: str, device):
    import torch
    from transformers import AutoModelForCausalLM

    from qerl.nvfp4.quantize import quantize_model

    config = model_config(size)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    std = config.initializer_range
    unit_offset = config.model_type == "gemma3_text"  # its norms scale by 1 + w: w = 0 is the identity scale

    def materialize(module):
        module.to_empty(device=device, recurse=True)
        for sub in module.modules():
            if isinstance(sub, (torch.nn.Linear, torch.nn.Embedding)):
                sub.weight.normal_(0, std)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()
            elif hasattr(sub, "weight") and sub.weight is not None and sub.weight.dim() == 1:
                sub.weight.fill_(0.0 if unit_offset else 1.0)  # norms
            if hasattr(sub, "embed_scale"):  # Gemma's sqrt(hidden), a buffer to_empty left unset
                sub.embed_scale.fill_(sub.scalar_embed_scale)

    inner = model.model
    for name, child in inner.named_children():
        if name == "layers":
            for layer in child:
                materialize(layer)
                if precision == "nvfp4":
                    quantize_model(layer)
        elif name == "rotary_emb":  # its inv_freq is computed, not initialized: rebuild it on the device
            inner.rotary_emb = type(child)(config=config, device=device)
        else:
            materialize(child)
    if config.tie_word_embeddings:  # to_empty gave the embedding a new weight: the head takes it again
        model.lm_head.weight = inner.embed_tokens.weight
    else:
        materialize(model.lm_head)
    return model.eval()


def padded_tokenizer(vocab_size: int):
    """The demo's character tokenizer with filler tokens up to `vocab_size`, so sampled ids all decode."""
    from qerl.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens([f"<f{i}>" for i in range(vocab_size - len(tokenizer))])
    return tokenizer


def with_lora(model, rank: int = 16):
    import torch
    from peft import get_peft_model

    from qerl import lora

    peft_model = get_peft_model(model, lora.lora_config(model, rank=rank, alpha=rank))  # as TRL wraps the base
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    return peft_model
