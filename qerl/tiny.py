"""A tiny Qwen2 (or Qwen3, or Gemma-3 text) causal LM and a character-level chat tokenizer, built in code (no
downloads).

Used by the tests and the demo. The tokenizer is a real `PreTrainedTokenizerFast` (tokenizers library) with a
chat template, pad and eos tokens, so TRL treats it like any hub tokenizer.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

PAD, UNK, EOS = "<pad>", "<unk>", "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, UNK, EOS, *ROLE_TOKENS)
CHARACTERS = string.printable  # digits, letters, punctuation, whitespace: enough for GSM8K-like text

# Every turn is <|role|>content<|end|>; generation starts after <|assistant|>. Short on purpose: each
# character is a token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per char
    backend.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=EOS,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    architecture: str = "qwen2",
    head_dim: int | None = None,
    sliding_window: int | None = None,
) -> Qwen2ForCausalLM | Qwen3ForCausalLM | Gemma3ForCausalLM:
    """A randomly initialised Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, no biases, its own head_dim) or
    Gemma-3 text model whose projections are NVFP4-compatible (in_features % 16 == 0).

    Gemma-3 at this size keeps what sets it apart: (1 + w) norms, four per layer, q/k norms, embeddings scaled by
    sqrt(hidden) and tied to the LM head, a GELU-tanh MLP, every third layer global (rotary base 1e6, linear
    scaling 8, as Gemma-3-4B's) and the others local (base 1e4, a sliding window of 8 tokens), and a
    query_pre_attn_scalar that is not head_dim. `sliding_window` sets Gemma-3's local window, and gives Qwen2/Qwen3
    one (use_sliding_window) on every layer after the first."""
    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[architecture]
    extra = {"head_dim": head_dim} if head_dim is not None else {}
    if sliding_window is not None and architecture != "gemma3":
        extra.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1)
    if architecture == "gemma3":
        head_dim = head_dim or hidden_size // num_heads
        extra = dict(
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim // 2,
            sliding_window=sliding_window or 8,
            layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            },
        )
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=architecture == "gemma3",  # as Gemma-3's checkpoints; the others keep theirs apart
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model


def build_tiny(dtype: torch.dtype = torch.float32, seed: int = 0, **model_kwargs):
    """(model, tokenizer) pair."""
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer, dtype=dtype, seed=seed, **model_kwargs), tokenizer


def save_tiny_checkpoints(root, model=None, tokenizer=None, seed: int = 0) -> tuple[str, str]:
    """Write a BF16 checkpoint folder and its NVFP4 quantization (our quantizer) under `root`.

    Returns (bf16_dir, nvfp4_dir). The model is stored in bfloat16, as a hub checkpoint would be.
    """
    import os

    from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint

    if model is None:
        model, tokenizer = build_tiny(seed=seed)
    bf16_dir, nvfp4_dir = os.path.join(root, "bf16"), os.path.join(root, "nvfp4")
    model.to(torch.bfloat16).save_pretrained(bf16_dir)
    tokenizer.save_pretrained(bf16_dir)
    quantize_checkpoint(bf16_dir, nvfp4_dir, device="cpu", overwrite=True)
    return bf16_dir, nvfp4_dir
