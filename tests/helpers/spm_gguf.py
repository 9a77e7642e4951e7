"""A small GGUF with a SentencePiece-BPE tokenizer laid out as llama.cpp writes Gemma-3's (tokenizer.ggml.model
"llama", no merges: the scores rank the pieces), optionally with a tiny Gemma-3 model's F32 weights: behind
tests/qerl/models/test_gguf_tokenizer.py.

The vocabulary has what makes Gemma's tokenizer hard to rebuild: control tokens (<bos>, <start_of_turn>, ...),
user-defined ones (newline, space and tab runs written with real spaces and tabs, "<table>"), the 256 byte tokens,
and normal pieces whose merges are not unique ("abc" from "a"+"bc" or "ab"+"c", with "bc" scoring above "ab").
"""

from pathlib import Path

import numpy as np

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
USER_DEFINED = ["\n", "\n\n", "\n\n\n", "  ", "   ", "    ", "\t", "\t\t", "<table>", "</table>"]
TURNS = ["<start_of_turn>", "<end_of_turn>"]
# Normal pieces, highest score first (score = -rank, as Gemma's): merged pieces, then single characters.
MERGED = [
    "▁t", "he", "▁the", "in", "er", "▁o", "▁of", "is", "▁is", "an", "ce", "ance", "▁F", "ra", "▁Fr", "▁France",
    "Th", "The", "▁c", "ap", "▁cap", "it", "al", "ital", "▁capital", "bc", "ab", "abc", "ll", "lo", "llo", "He",
    "Hello", "▁w", "or", "ld", "▁wor", "▁world", "▁a", "▁ab", "us", "▁us", "user", "mo", "de", "del", "model",
]  # fmt: skip
CHARS = list("▁abcdefghijklmnopqrstuvwxyzFHTW.,!?:0123456789+=é")

# Gemma 3's turn format (the registry's template is the same; the GGUF this mimics carries none).
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}"
    "{{- message['content'] | trim + '<end_of_turn>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) in Gemma's order: control and user-defined tokens, bytes, normal pieces."""
    import gguf

    T = gguf.TokenType
    tokens, scores, types = [], [], []

    def add(token, score, kind):
        assert token not in tokens, token
        tokens.append(token), scores.append(score), types.append(kind)

    for t in CONTROL:
        add(t, -1000.0, T.CONTROL)
    add("[multimodal]", -1000.0, T.USER_DEFINED)
    for n in range(2):
        add(f"<unused{n}>", -1000.0, T.CONTROL)
    for t in TURNS:
        add(t, -1000.0, T.CONTROL)
    for t in USER_DEFINED:
        add(t, -1000.0, T.USER_DEFINED)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, T.BYTE)
    for rank, t in enumerate(MERGED + CHARS):
        add(t, -float(rank), T.NORMAL)
    return tokens, scores, [int(k) for k in types]


def write_sentencepiece_gguf(
    path: Path, weights: bool = False, chat_template: str | None = None, add_space_prefix: bool = False, seed: int = 0
) -> Path:
    """The GGUF at `path`: the vocabulary above (bos 2, eos 1, unk 3, pad 0, add_bos_token), and with `weights` a
    2-layer Gemma-3 (hidden 64, 4 heads of 16, one KV head) in F32, its norms stored as llama.cpp stores Gemma's."""
    import gguf

    tokens, scores, types = sentencepiece_vocab()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny-gemma3-spm")
    hidden, layers, ffn, heads, head_dim = 64, 2, 128, 4, 16
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(8)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    rng = np.random.default_rng(seed)

    def tensor(name, shape, scale=0.05, offset=0.0):
        writer.add_tensor(name, (offset + scale * rng.standard_normal(shape)).astype(np.float32))

    if weights:
        tensor("token_embd.weight", (len(tokens), hidden))
        for i in range(layers):
            for name, shape in (
                ("attn_q", (heads * head_dim, hidden)),
                ("attn_k", (head_dim, hidden)),
                ("attn_v", (head_dim, hidden)),
                ("attn_output", (hidden, heads * head_dim)),
                ("ffn_gate", (ffn, hidden)),
                ("ffn_up", (ffn, hidden)),
                ("ffn_down", (hidden, ffn)),
            ):
                tensor(f"blk.{i}.{name}.weight", shape)
            for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
                tensor(f"blk.{i}.{norm}.weight", (hidden,), scale=0.1, offset=1.0)  # 1 + w, as llama.cpp stores
            for norm in ("attn_q_norm", "attn_k_norm"):
                tensor(f"blk.{i}.{norm}.weight", (head_dim,), scale=0.1, offset=1.0)
        tensor("output_norm.weight", (hidden,), scale=0.1, offset=1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
