"""A GGUF file -> a BF16 transformers checkpoint folder, with the special tokens a chat model needs.

transformers reads GGUF itself (`from_pretrained(folder, gguf_file=...)`, with the `gguf` package): it dequantizes
the weights and rebuilds the tokenizer from the file's metadata. Two things stop there being a usable checkpoint:
the loaded model refuses `save_pretrained` (it remembers it came from GGUF), and the tokenizer's special tokens
are whatever the GGUF metadata says. So the weights move into a plain model of the same config, and the tokenizer,
config.json and generation_config.json get the entry's EOS and pad token. A SentencePiece-BPE tokenizer (Gemma's)
transformers rebuilds wrongly: that one is built from the GGUF's metadata instead (gguf_tokenizer.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# config.json keys that describe the GGUF file, not the model: its general.name, and the GGUF quantization_config
# (which would make every later load look for the GGUF file).
_GGUF_KEYS = ("_name_or_path", "_model_name_or_path", "name_or_path", "quantization_config")


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """The model as transformers' own GGUF loader gives it: the trusted reference of the weights' conversion."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)


def gguf_tokenizer(path: str | Path, chat_template: str | None = None):
    """The checkpoint's tokenizer: a SentencePiece-BPE GGUF's built from its metadata here, any other (byte-level
    BPE: SmolLM2's, Qwen's) transformers' own. `chat_template` replaces the GGUF's (None: keep it)."""
    from transformers import AutoTokenizer

    from qerl.models.gguf_tokenizer import sentencepiece_tokenizer

    path = Path(path)
    tokenizer = sentencepiece_tokenizer(path, chat_template)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
    return tokenizer


def fix_special_tokens(tokenizer, eos_token: str, pad_token: str) -> None:
    """Set EOS and pad by name; both must be single tokens of the vocabulary."""
    vocab = tokenizer.get_vocab()
    for role, token in (("eos_token", eos_token), ("pad_token", pad_token)):
        if token not in vocab:
            raise ValueError(f"{role} {token!r} is not a token of this tokenizer's vocabulary")
    tokenizer.eos_token, tokenizer.pad_token = eos_token, pad_token
    # clean_up_tokenization_spaces strips spaces before punctuation: wrong for a BPE vocabulary (and transformers
    # warns at every decode).
    tokenizer.clean_up_tokenization_spaces = False


def convert_gguf(
    path: str | Path,
    out_dir: str | Path,
    eos_token: str,
    pad_token: str,
    chat_template: str | None = None,
    stop_tokens: tuple[str, ...] = (),
) -> None:
    """Write the GGUF at `path` into `out_dir` as BF16 safetensors + config + tokenizer + generation config;
    `chat_template` for a GGUF without one (or a wrong one); `stop_tokens`: more EOS ids for sampling to stop at."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    loaded, tokenizer = load_gguf_model(path), gguf_tokenizer(path, chat_template)
    fix_special_tokens(tokenizer, eos_token, pad_token)
    if loaded.config.max_position_embeddings:
        tokenizer.model_max_length = loaded.config.max_position_embeddings

    config = loaded.config
    for key in _GGUF_KEYS:
        config.__dict__.pop(key, None)
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied LM head is the embedding itself: its absence from the GGUF's tensors is expected.
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{path}: GGUF tensors do not match {type(model).__name__}: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    model.tie_weights()
    stops = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(stop_tokens))]
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stops if len(stops) > 1 else stops[0],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
