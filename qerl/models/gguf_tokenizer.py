"""A SentencePiece-BPE tokenizer (Gemma's; llama.cpp names it `tokenizer.ggml.model = "llama"`) rebuilt from a GGUF's
own metadata, as llama.cpp tokenizes with it.

transformers' GGUF loader gets this kind wrong: for Gemma-3 it builds a Unigram model that, saved and reloaded,
becomes a BPE without merges (one token per character, no <bos>, <start_of_turn> in text cut into pieces, tokens
renamed). Here every token keeps its id and exact string, and:
  - text is cut at the control tokens (type 3) and user-defined ones (type 4: "\\n", whitespace runs, "<table>"...)
    first, matched in the raw text; control tokens are special (skipped by decode(skip_special_tokens=True)), the
    user-defined ones not;
  - the rest has its spaces replaced by U+2581 and no prefix space, then is merged as SentencePiece-BPE does: the
    adjacent pair whose concatenation is the highest-scoring normal token first. A tokenizers BPE does exactly that
    when its merges are every split of a normal token into two normal tokens, ranked by that token's score;
  - a character outside the vocabulary becomes its UTF-8 bytes' <0xXX> tokens (byte fallback);
  - <bos> (<eos>) is added where the GGUF's add_bos_token (add_eos_token) says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SENTENCEPIECE = "llama"  # tokenizer.ggml.model of a SentencePiece vocabulary: Llama's, Gemma's
# llama.cpp's token types (gguf.TokenType).
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
SPACE = "\u2581"  # SentencePiece's visible space


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF's tokenizer metadata (tokenizer.ggml.*), as llama.cpp reads it."""

    path: Path
    model: str
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None


def _array(reader, key: str) -> list:
    """An array field's items; read part by part (the gguf package's contents() takes seconds on 262k tokens)."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return []
    if field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return [field.parts[i][0].item() for i in field.data]


def _scalar(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_vocab(path: str | Path) -> GGUFVocab:
    """The tokenizer metadata of the GGUF at `path`; a file without a token list is refused, naming it."""
    import gguf

    path = Path(path)
    reader = gguf.GGUFReader(path)
    tokens = _array(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: no tokenizer.ggml.tokens; not a GGUF with a tokenizer")
    return GGUFVocab(
        path=path,
        model=_scalar(reader, "tokenizer.ggml.model", ""),
        tokens=tokens,
        scores=_array(reader, "tokenizer.ggml.scores"),
        types=_array(reader, "tokenizer.ggml.token_type"),
        bos_id=_scalar(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_scalar(reader, "tokenizer.ggml.eos_token_id"),
        unk_id=_scalar(reader, "tokenizer.ggml.unknown_token_id"),
        pad_id=_scalar(reader, "tokenizer.ggml.padding_token_id"),
        add_bos=bool(_scalar(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(_scalar(reader, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(_scalar(reader, "tokenizer.ggml.add_space_prefix", True)),  # llama.cpp's default
        chat_template=_scalar(reader, "tokenizer.chat_template"),
    )


def _check(vocab: GGUFVocab) -> None:
    """One line naming the file for metadata this builder cannot honour."""
    n = len(vocab.tokens)
    if len(vocab.scores) != n or len(vocab.types) != n:
        raise ValueError(
            f"{vocab.path}: {n} tokens but {len(vocab.scores)} scores and {len(vocab.types)} token types; "
            "a SentencePiece vocabulary needs one of each per token"
        )
    if vocab.add_space_prefix:  # Llama-2's: llama.cpp prefixes a space after every special token; not built here
        raise ValueError(f"{vocab.path}: tokenizer.ggml.add_space_prefix is true; only Gemma's (false) is supported")
    for role in ("bos", "eos", "unk", "pad"):
        token_id = getattr(vocab, f"{role}_id")
        if token_id is not None and not 0 <= token_id < n:
            raise ValueError(f"{vocab.path}: tokenizer.ggml.{role}_token_id {token_id} is outside the {n} tokens")
    # SentencePiece starts from characters, vocabulary or not; a BPE's merges start from tokens: they merge alike
    # only while every character of a normal token is itself one (SentencePiece's trainer makes it so).
    normal = {t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == NORMAL}
    stray = next((c for t in normal for c in t if c not in normal), None)
    if stray is not None:
        raise ValueError(f"{vocab.path}: the character {stray!r} is in normal tokens but is not one itself")
    present = set(vocab.tokens)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in present]
    if missing:
        raise ValueError(
            f"{vocab.path}: {len(missing)} byte tokens missing ({missing[0]}...); byte fallback needs all 256"
        )


def sentencepiece_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """Every split of a normal token into two normal tokens, highest-scoring token first (ties: lower id first).

    SentencePiece-BPE merges the adjacent pair whose concatenation scores highest; a BPE merging the lowest-ranked
    pair does the same with these ranks. Two splits of one token share its score; they can never both apply at one
    place, so their order does not matter. Initial symbols are single characters, each a normal token (_check), so no
    possible merge is missing."""
    normal = {t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == NORMAL}
    ranked = []
    for token_id, (token, score, kind) in enumerate(zip(vocab.tokens, vocab.scores, vocab.types, strict=True)):
        if kind != NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-score, token_id, left, right))
    ranked.sort(key=lambda m: (m[0], m[1]))  # stable: a token's splits stay in cut order
    return [(left, right) for _, _, left, right in ranked]


def build_tokenizer(vocab: GGUFVocab, chat_template: str | None = None):
    """A transformers PreTrainedTokenizerFast of `vocab` (a SentencePiece-BPE GGUF's); `chat_template` replaces the
    GGUF's own (None: keep it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    _check(vocab)
    tokens = vocab.tokens
    unk = tokens[vocab.unk_id] if vocab.unk_id is not None else None
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=sentencepiece_merges(vocab),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
        dropout=None,
    )
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.Replace(" ", SPACE)  # no Prepend: Gemma adds no prefix space
    backend.pre_tokenizer = None  # the whole text between added tokens is one sequence, as in llama.cpp
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    # Added in id order, each keeps its vocabulary id; normalized=False: matched in the raw text ("  " is a
    # whitespace-run token, not two U+2581).
    backend.add_tokens(
        [
            AddedToken(t, special=kind == CONTROL, normalized=False)
            for t, kind in zip(tokens, vocab.types, strict=True)
            if kind in (CONTROL, USER_DEFINED)
        ]
    )
    bos = tokens[vocab.bos_id] if vocab.bos_id is not None else None
    eos = tokens[vocab.eos_id] if vocab.eos_id is not None else None
    head = [bos] if vocab.add_bos and bos is not None else []
    tail = [eos] if vocab.add_eos and eos is not None else []
    backend.post_processor = processors.TemplateProcessing(
        single=[*head, "$A", *tail],
        pair=[*head, "$A", *tail, *head, "$B:1", *tail],
        special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(head + tail)],
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=tokens[vocab.pad_id] if vocab.pad_id is not None else None,
        add_bos_token=vocab.add_bos,
        add_eos_token=vocab.add_eos,
        clean_up_tokenization_spaces=False,
    )
    template = chat_template if chat_template is not None else vocab.chat_template
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def sentencepiece_tokenizer(path: str | Path, chat_template: str | None = None):
    """The GGUF's tokenizer rebuilt here when it is SentencePiece-BPE; None for another kind (gpt2 byte-level BPE:
    transformers' own GGUF tokenizer is right for those)."""
    vocab = read_vocab(path)
    if vocab.model != SENTENCEPIECE:
        return None
    return build_tokenizer(vocab, chat_template)
