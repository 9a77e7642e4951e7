"""docs/guide.md's path for SmolLM2-135M on a CPU (fetch, quantize, qerl.train, eval.gsm8k) runs as the guide prints
it, in a folder laid out as a clone (its configs/ and tests/data/), with a tiny model where the fetch would download
SmolLM2: the fetch finds it already there (its record says so) and reuses it, as a second fetch does."""

import json
import os
import re
import shlex
import time

import pytest
import torch

from benchmarks.launch import REPO
from eval import gsm8k
from qerl import cli, quantize, train
from qerl.models import __main__ as models
from qerl.models.fetch import FETCH_RECORD, _record, entry_for
from qerl.tiny import CHAT_TEMPLATE, EOS, PAD, ROLE_TOKENS, UNK, build_tiny_model

GUIDE = REPO / "docs" / "guide.md"
SECTION = "### On a CPU: fetch, quantize, train, evaluate"
PROGRAMS = {
    "qerl.models": models.main,
    "qerl.quantize": quantize.main,
    "qerl.train": lambda argv: train.main(argv) and 0,
    "eval.gsm8k": gsm8k.main,
}


def guide_path(section: str = SECTION) -> list[list[str]]:
    """The argument lists of the commands in the section's code block, continuations joined, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", GUIDE.read_text().split(section, 1)[1], flags=re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def word_tokenizer(texts):
    """A tokenizer of whole words and punctuation marks with the tiny models' chat template: GSM8K prompts come out
    about as long in tokens as SmolLM2's (110-230), where the tiny character tokenizer makes them 320-770."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({word for text in texts for word in re.findall(r"\w+|[^\w\s]", text)})
    vocab = {token: i for i, token in enumerate([PAD, UNK, EOS, *ROLE_TOKENS, *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, unk_token=UNK, eos_token=EOS,
        additional_special_tokens=list(ROLE_TOKENS), padding_side="left",
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_the_guides_cpu_path_runs_as_printed(tmp_path, monkeypatch, capsys):
    from qerl import data

    commands = guide_path()
    assert [argv[:3] for argv in commands] == [["python", "-m", program] for program in PROGRAMS]
    fetch = commands[0]
    name, folder = fetch[4], tmp_path / fetch[fetch.index("--output") + 1]
    texts = [row[key] for path in data.GSM8K_DATA.glob("*.jsonl") for line in path.read_text().splitlines()
             for row in [json.loads(line)] for key in ("question", "answer")]  # fmt: skip
    texts.append(data.GSM8K_HASH_INSTRUCTION)
    tokenizer = word_tokenizer(texts)
    build_tiny_model(tokenizer, max_position_embeddings=1024).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / FETCH_RECORD).write_text(json.dumps(_record(name, entry_for(name))))
    for part in ("configs", "tests"):
        (tmp_path / part).symlink_to(REPO / part)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    for argv in commands:
        assert cli.run_cli(PROGRAMS[argv[2]], argv[2], argv[3:]) == 0, argv
    out = capsys.readouterr().out
    assert f"qerl.models: {name} -> {fetch[fetch.index('--output') + 1]} (already there, reused" in out
    limit = commands[-1][commands[-1].index("--limit") + 1]
    assert re.search(rf"eval.gsm8k: accuracy \d+\.\d% \(95% CI .*, n={limit}\)", out), out


GPU_SECTION = "### On one GPU: fetch, quantize, train, evaluate"
GPU_INPUTS = ("QERL_Q15_GGUF", "GSM8K_TRAIN", "GSM8K_TEST")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not all(os.path.isfile(os.environ.get(name, "")) for name in GPU_INPUTS),
    reason=f"needs CUDA and the files {', '.join(GPU_INPUTS)} name",
)
def test_the_guides_gpu_path_runs_as_printed(tmp_path, monkeypatch, capsys):
    """The 1.5B's path on one GPU, as the guide prints it (the GGUF given to the fetch as its comment says, the
    GSM8K files from the environment), each command timed; the adapter it trains scores on all 1,319 problems."""
    commands = guide_path(GPU_SECTION)
    assert [argv[:3] for argv in commands] == [["python", "-m", program] for program in PROGRAMS]
    for name in GPU_INPUTS:  # the commands run in a folder of their own
        monkeypatch.setenv(name, os.path.abspath(os.environ[name]))
    commands[0] += ["--gguf", os.environ["QERL_Q15_GGUF"]]
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    seconds = {}
    for argv in commands:
        argv = [os.path.expandvars(arg) for arg in argv]
        start = time.perf_counter()
        assert cli.run_cli(PROGRAMS[argv[2]], argv[2], argv[3:]) == 0, argv
        seconds[argv[2]] = round(time.perf_counter() - start, 1)
    out = capsys.readouterr().out
    scored = re.search(r"eval.gsm8k: accuracy \d+\.\d% \(95% CI .*, n=1319\)", out)
    with capsys.disabled():
        print(f"\nthe guide's GPU path on {torch.cuda.get_device_name()}: {json.dumps(seconds)} s")
        print(scored.group(0) if scored else "eval.gsm8k printed no accuracy line")
    assert scored, out
