"""An independent SentencePiece-BPE encoder, written out from llama.cpp's rules (llm_tokenizer_spm, with special
tokens parsed), plain Python, no tokenizers library: the reference qerl/models/gguf_tokenizer.py is held to in
tests/qerl/models/test_gguf_tokenizer.py.

  1. The raw text is cut at control (type 3) and user-defined (type 4) tokens, longest token first, each found
     left to right in every piece not yet cut.
  2. In each remaining piece, spaces become U+2581 (no prefix space), the symbols start as its characters, and
     the adjacent pair whose concatenation is the highest-scoring normal token merges, leftmost first on a tie,
     until no pair is a token.
  3. A symbol that is not a token becomes the <0xXX> tokens of its UTF-8 bytes.
"""

CONTROL, USER_DEFINED, NORMAL = 3, 4, 1


def _cut_at_specials(text: str, specials: list[str]) -> list[tuple[str, bool]]:
    pieces = [(text, False)]
    for special in sorted(specials, key=len, reverse=True):
        cut = []
        for piece, is_special in pieces:
            if is_special:
                cut.append((piece, True))
                continue
            while (at := piece.find(special)) >= 0:
                if at:
                    cut.append((piece[:at], False))
                cut.append((special, True))
                piece = piece[at + len(special) :]
            if piece:
                cut.append((piece, False))
        pieces = cut
    return pieces


def _merge(piece: str, normal: dict[str, float]) -> list[str]:
    symbols = list(piece.replace(" ", "\u2581"))
    while True:
        best = None  # (score, -position)
        for i in range(len(symbols) - 1):
            joined = symbols[i] + symbols[i + 1]
            if joined in normal and (best is None or normal[joined] > best[0]):
                best = (normal[joined], i)
        if best is None:
            return symbols
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]


def encode(text: str, tokens: list[str], scores: list[float], types: list[int], bos_id: int | None) -> list[int]:
    """The ids of `text`, <bos> first when bos_id is given."""
    ids = {t: i for i, t in enumerate(tokens)}
    normal = {t: s for t, s, kind in zip(tokens, scores, types, strict=True) if kind == NORMAL}
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, USER_DEFINED)]
    out = [] if bos_id is None else [bos_id]
    for piece, is_special in _cut_at_specials(text, specials):
        if is_special:
            out.append(ids[piece])
            continue
        for symbol in _merge(piece, normal):
            if symbol in normal:
                out.append(ids[symbol])
            else:
                out.extend(ids[f"<0x{byte:02X}>"] for byte in symbol.encode("utf-8"))
    return out
