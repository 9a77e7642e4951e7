"""A tiny GGUF, written with the gguf package as llama.cpp's converter writes SmolLM2's (Q4_1), Qwen2.5's or Qwen3's:
behind the `tiny_gguf` and `converted` fixtures of tests/conftest.py, and tests/qerl/models/test_gguf.py."""

from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> unicode table: every byte is a token, so any text encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(extra))]


def write_tiny_gguf(path: Path, arch="llama", hidden=64, layers=2, ffn=128, heads=4, kv_heads=2, seed=0) -> Path:
    """A GGUF as llama.cpp's converter writes SmolLM2's (arch "llama"), Qwen2.5's ("qwen2": q/k/v biases in F32,
    rope base 1e6) or Qwen3's ("qwen3": no biases, head_dim 128, F32 per-head q/k RMSNorm weights): Q4_1
    projections and embedding, F32 norms, a byte-level BPE tokenizer with ChatML specials, tied embeddings, and
    SmolLM2's wrong metadata (eos = bos = <|im_start|>, no pad token)."""
    import gguf
    from gguf.quants import quantize

    merges = ["Ġ t", "Ġ a", "h e", "i n"]
    tokens = SPECIALS + _byte_level_alphabet() + [m.replace(" ", "") for m in merges]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    # Qwen3 sets head_dim apart from hidden / heads (128 in every dense Qwen3). llama.cpp writes it as key_length,
    # which transformers' qwen3 GGUF mapping does not read: it takes Qwen3Config's default, 128.
    head_dim = 128 if arch == "qwen3" else hidden // heads
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    qwen = arch in ("qwen2", "qwen3")
    writer.add_rope_freq_base(1e6 if qwen else 10000.0)
    writer.add_layer_norm_rms_eps(1e-6 if qwen else 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(1)  # SmolLM2's GGUF says <|im_start|>
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def q4_1(name, shape):
        packed = quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    q, kv = head_dim * heads, head_dim * kv_heads
    q4_1("token_embd.weight", (len(tokens), hidden))
    for i in range(layers):
        for name, shape in (
            ("attn_q", (q, hidden)),
            ("attn_k", (kv, hidden)),
            ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, q)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ):
            q4_1(f"blk.{i}.{name}.weight", shape)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{i}.{name}.bias", (0.5 * rng.standard_normal(shape[0])).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        if arch == "qwen3":
            for norm in ("attn_q_norm", "attn_k_norm"):  # over one head's dimensions
                writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.standard_normal(head_dim)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
