"""The SentencePiece-BPE tokenizer rebuilt from a GGUF's metadata (qerl/models/gguf_tokenizer.py): on a small GGUF
laid out as Gemma-3's (tests/helpers/spm_gguf.py) against an independent encoder written from llama.cpp's rules
(tests/helpers/spm_reference.py), before and after a save and reload; the conversion that writes it into a
checkpoint."""

import dataclasses

import pytest
import torch
from spm_gguf import CHAT_TEMPLATE, sentencepiece_vocab, write_sentencepiece_gguf
from spm_reference import encode

from qerl import base_model
from qerl.models.gguf import convert_gguf, gguf_tokenizer, load_gguf_model
from qerl.models.gguf_tokenizer import build_tokenizer, read_vocab, sentencepiece_merges, sentencepiece_tokenizer

STRINGS = [
    "The capital of France is",
    "Hello world, the user is here!",
    "abc abcd bca cab",  # "abc" merges as a+bc ("bc" outscores "ab"), not ab+c
    "  two leading spaces, three   inside, two trailing  ",
    "x" + " " * 9 + "y",  # longer than the longest space run token: cut longest first
    "tab\there\t\tand\t\t\tthree",
    "line\nbreak\n\n\nthree\n\n\n\n\nfive",
    "café über Zürich",  # ü and Z are not in the vocabulary: their UTF-8 bytes
    "emoji 😀! and \x07 a bell",
    "<start_of_turn>user\nWhat is 12 + 7?<end_of_turn>\n<start_of_turn>model\n19<end_of_turn>\n",
    "<table>the</table> [multimodal] <mask><unused0>",
    "<0x41> is text, not the byte token",
    "",
]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    return write_sentencepiece_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def loaded(spm_gguf, tmp_path_factory):
    """The tokenizer as built, and as a checkpoint folder gives it back to qerl and to transformers' AutoTokenizer."""
    from transformers import AutoTokenizer

    built = sentencepiece_tokenizer(spm_gguf)
    folder = tmp_path_factory.mktemp("spm-tokenizer")
    built.save_pretrained(folder)
    return {
        "built": built,
        "load_tokenizer": base_model.load_tokenizer(folder),
        "auto": AutoTokenizer.from_pretrained(folder),
    }


def tokens_of(tokens: list[str]) -> list[int]:
    vocab = sentencepiece_vocab()[0]
    return [vocab.index(t) for t in tokens]


def _reference(text: str, bos: bool = True) -> list[int]:
    tokens, scores, types = sentencepiece_vocab()
    return encode(text, tokens, scores, types, bos_id=2 if bos else None)


@pytest.mark.parametrize("text", STRINGS, ids=range(len(STRINGS)))
def test_ids_equal_the_reference_encoder(loaded, text):
    expected = _reference(text)
    for how, tokenizer in loaded.items():
        assert tokenizer(text)["input_ids"] == expected, how
        assert tokenizer.decode(expected, skip_special_tokens=False) == "<bos>" + text, how


def test_every_token_keeps_its_id_and_string(loaded):
    tokens, _, types = sentencepiece_vocab()
    for how, tokenizer in loaded.items():
        assert len(tokenizer) == len(tokens), how
        assert tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) == tokens, how  # "<0x09>", "  " included
        added = tokenizer.added_tokens_decoder  # control tokens special, user-defined ones not
        assert {i: t.special for i, t in added.items()} == {i: k == 3 for i, k in enumerate(types) if k in (3, 4)}, how
        ids = tokenizer("<start_of_turn>user\nHi<end_of_turn>\n")["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi\n", how  # control gone, "\n" kept
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0), how


def test_chat_turns_tokenize_with_one_id_per_control_token(loaded):
    messages = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "the user"}]
    for how, tokenizer in loaded.items():
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert (
            text == "<bos><start_of_turn>user\nHello world<end_of_turn>\n<start_of_turn>model\nthe user<end_of_turn>\n"
            "<start_of_turn>model\n"
        )
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert ids == _reference(text, bos=False), how  # the template's <bos>, not a second one
        start, end = tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
        assert ids[:2] == [2, start] and ids.count(start) == 3 and ids.count(end) == 2, how


def test_merges_are_every_split_into_normal_tokens_best_score_first(spm_gguf):
    merges = sentencepiece_merges(read_vocab(spm_gguf))
    assert ("a", "bc") in merges and ("ab", "c") in merges  # both roads to "abc"
    assert merges.index(("b", "c")) < merges.index(("a", "b")) < merges.index(("a", "bc"))
    assert not any("\n" in left + right or "<" in left + right for left, right in merges)  # normal tokens only


def test_a_chat_template_argument_replaces_the_ggufs(spm_gguf):
    tokenizer = sentencepiece_tokenizer(spm_gguf, chat_template="{{ messages[0]['content'] }}")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False) == "the"


def test_refusals_name_the_file(spm_gguf, tmp_path):
    spaced = write_sentencepiece_gguf(tmp_path / "spaced.gguf", add_space_prefix=True)
    with pytest.raises(ValueError, match=f"{spaced}: tokenizer.ggml.add_space_prefix is true"):
        sentencepiece_tokenizer(spaced)
    vocab = read_vocab(spm_gguf)

    def renamed(old: str, new: str) -> list[str]:
        return [new if t == old else t for t in vocab.tokens]

    for bad, message in (
        ({"scores": vocab.scores[:-1]}, r"\d+ tokens but \d+ scores"),
        ({"tokens": renamed("▁the", "▁thZ")}, "the character 'Z' is in normal tokens but is not one itself"),
        ({"tokens": renamed("<0x41>", "<byte41>")}, "1 byte tokens missing \\(<0x41>"),
        ({"eos_id": len(vocab.tokens)}, r"tokenizer.ggml.eos_token_id \d+ is outside"),
    ):
        with pytest.raises(ValueError, match=f"^{spm_gguf}: {message}"):
            build_tokenizer(dataclasses.replace(vocab, **bad))


def test_a_byte_level_bpe_gguf_keeps_transformers_tokenizer(tiny_gguf):
    """SmolLM2's and Qwen's (tokenizer.ggml.model "gpt2"): not rebuilt here."""
    assert sentencepiece_tokenizer(tiny_gguf) is None
    tokenizer = gguf_tokenizer(tiny_gguf)
    assert tokenizer("<|im_start|>user")["input_ids"][0] == 1


def test_conversion_writes_the_rebuilt_tokenizer_beside_transformers_weights(tmp_path):
    """A tiny Gemma-3 GGUF (no chat template, as the real one) -> checkpoint: the weights give transformers' own
    GGUF logits, the tokenizer is the rebuilt one, and the entry's chat template and EOS are written."""
    from transformers import AutoModelForCausalLM

    path = write_sentencepiece_gguf(tmp_path / "tiny-gemma3.gguf", weights=True)
    out = tmp_path / "bf16"
    convert_gguf(path, out, eos_token="<end_of_turn>", pad_token="<pad>", chat_template=CHAT_TEMPLATE)
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    reference = load_gguf_model(path, dtype=torch.bfloat16)
    assert type(ours).__name__ == "Gemma3ForCausalLM"
    ids = torch.tensor([_reference("The capital of France is"), _reference("Hello world, the user is here")[:6]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)
    tokenizer = base_model.load_tokenizer(out)
    assert tokenizer("abc  bca\tthe")["input_ids"] == _reference("abc  bca\tthe")
    assert tokenizer.eos_token == "<end_of_turn>" and tokenizer.eos_token_id == tokens_of(["<end_of_turn>"])[0]
    assert tokenizer.pad_token_id == 0
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": " the "}], add_generation_prompt=True)
    text = "<bos><start_of_turn>user\nthe<end_of_turn>\n<start_of_turn>model\n"
    assert prompt["input_ids"] == _reference(text, bos=False)
