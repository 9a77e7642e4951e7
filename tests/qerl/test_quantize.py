"""`python -m qerl.quantize` (qerl/quantize.py): bad input refused in one line before anything loads (its TRIALS and
numeric flags), --overwrite and stale work folders, the round trip through compressed-tensors on four architectures,
a model it cannot quantize named without a traceback, and an interrupted run that leaves no output."""

import os
import re
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
from bad_input import Q, check_trial, check_zero_and_minus_one, range_flags, trial_ids
from checkpoint_models import CONFIGS, QUANTIZE, SIZES, _bf16_model, _decompressed_by_compressed_tensors
from clis import snapshot
from interrupts import assert_interrupted, start, wait_for
from transformers import AutoModelForCausalLM, Qwen2Config

from benchmarks.launch import REPO
from qerl import cli, quantize
from qerl.input_checks import FETCH_COMMAND
from qerl.nvfp4.checkpoint import load_nvfp4_model
from qerl.nvfp4.linear import NVFP4Linear

TRIALS = [
    # prog, argv, fragment(s) of the one line
    ("qerl.quantize", ["--model", "ck/bf16", "--output", "ck/bf16", "--overwrite"], "holds the input model"),
    ("qerl.quantize", ["--model", "parent/model", "--output", "parent", "--overwrite"], "holds the input model"),
    ("qerl.quantize", ["--model", "ck/bf16", "--output", ".", "--overwrite"], "holds the input model"),
    ("qerl.quantize", ["--model", "ck/bf16", "--output", "notes.txt", "--overwrite"], "notes.txt: is a file"),
    ("qerl.quantize", ["--model", "ck/bf16", "--output", "parent", "--overwrite"], "not a checkpoint this tool wrote"),
    ("qerl.quantize", ["--model", "ck/bf16", "--output", "ck/nvfp4"], "pass --overwrite"),
    ("qerl.quantize", ["--model", "./ck/nope", "--output", "out"], "./ck/nope: no such folder"),
    ("qerl.quantize", ["--model", "ck/nope", "--output", "out"], "ck/nope: no such folder"),
    ("qerl.quantize", ["--model", "notes.txt", "--output", "out"], "notes.txt: is a file"),
    ("qerl.quantize", ["--model", "truncated", "--output", "out"], "model.safetensors: truncated or corrupt"),
    ("qerl.quantize", ["--model", "nan", "--output", "out"], "model.norm.weight contains NaN or Inf"),
    ("qerl.quantize", ["--model", "ck/nvfp4", "--output", "out"], "already quantized"),
    ("qerl.quantize", [*Q, "--device", "gpu0"], "--device 'gpu0': not a device name"),
    ("qerl.quantize", [*Q, "--device", "cuda:7"], "--device 'cuda:7'"),
    ("qerl.quantize", [*Q, "--overwite"], "unknown flag --overwite (did you mean --overwrite?)"),
    ("qerl.quantize", [*Q, "--max-shard-gb", "-1"], "--max-shard-gb: must be a number > 0, got -1"),
    ("qerl.quantize", ["--model", "model.gguf", "--output", "out"], "model.gguf is a GGUF file", FETCH_COMMAND),
    ("qerl.quantize", ["--model", "t5", "--output", "out"], "T5ForConditionalGeneration (model_type 't5') is not a"),
    ("qerl.quantize", [*Q, "--gptq-calibration", "nothere.jsonl"], "--gptq-calibration nothere.jsonl: no such file"),
    ("qerl.quantize", [*Q, "--gptq-calibration", "broken.jsonl"], "broken.jsonl, line 2: not JSON"),
    (
        "qerl.quantize",
        [*Q, "--gptq-calibration", "nocolumn.jsonl"],
        "nocolumn.jsonl, line 1: lacks 'question' or 'answer'",
    ),
]


@pytest.mark.parametrize("trial", TRIALS, ids=trial_ids(TRIALS))
def test_bad_input_is_one_line_and_changes_nothing(world, monkeypatch, capsys, trial):
    check_trial(world, monkeypatch, capsys, trial)


@pytest.mark.parametrize("prog, flag", range_flags("qerl.quantize"))
def test_zero_and_minus_one_in_every_numeric_flag(prog, flag):
    check_zero_and_minus_one(prog, flag)


def test_overwrite_replaces_only_its_own_checkpoint_and_cleans_stale_work_folders(world, tmp_path, caplog):
    """A killed run's hidden work folder goes (its process is gone), with a line saying so; --overwrite replaces a
    checkpoint the tool wrote, and the source and its neighbours stay."""
    src = world / "ck" / "bf16"
    out = tmp_path / "out"
    dead = 2**31 - 1  # no such process
    stale = tmp_path / f".out.partial-{dead}"
    stale.mkdir()
    (stale / "half.safetensors").write_bytes(b"x" * 1000)
    live = tmp_path / f".out.partial-{os.getppid()}"  # a running process's work folder stays
    live.mkdir()
    source_before = snapshot(src)
    for overwrite in ([], ["--overwrite"]):
        code = cli.run_cli(quantize.main, "qerl.quantize", ["--model", str(src), "--output", str(out), *overwrite])
        assert code == 0
    assert any(f"removed {stale}" in r.getMessage() and "did not finish" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])
    assert snapshot(src) == source_before
    assert (out / "generation_config.json").is_file() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_cli_round_trip_logits_equal_compressed_tensors(seed, tmp_path, arch):
    _bf16_model(arch, tmp_path / "bf16")
    result = subprocess.run(
        [*QUANTIZE, "--model", str(tmp_path / "bf16"), "--output", str(tmp_path / "nvfp4")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    side_files = {p.name for p in (tmp_path / "bf16").iterdir() if p.suffix != ".safetensors"}
    assert side_files <= {p.name for p in (tmp_path / "nvfp4").iterdir()}  # generation_config.json among them
    ours = load_nvfp4_model(tmp_path / "nvfp4", device="cpu")
    assert isinstance(ours.model.layers[0].mlp.down_proj, NVFP4Linear)
    assert type(ours.lm_head) is torch.nn.Linear
    ref = _decompressed_by_compressed_tensors(tmp_path / "nvfp4")
    tokens = torch.randint(0, SIZES["vocab_size"], (3, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, ref(tokens).logits, rtol=0, atol=0)


def test_cli_reports_bad_input_without_traceback(tmp_path):
    config = Qwen2Config(**{**SIZES, "hidden_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2})
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "odd")
    result = subprocess.run(
        [*QUANTIZE, "--model", str(tmp_path / "odd"), "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "in_features=40 is not divisible" in result.stderr and "Traceback" not in result.stderr
    assert re.search(r"model\.layers\.0\.(self_attn|mlp)\.\w+_proj\.weight \(model\.safetensors\)", result.stderr)
    assert not (tmp_path / "out").exists()


# Holds the quantizer before it writes its one shard (its work folder exists by then) for a minute: the signal comes
# in that minute.
QUANTIZE_HARNESS = textwrap.dedent("""
    import runpy, sys, time
    from qerl.nvfp4.checkpoint import write

    flush, marker = write.ShardWriter.flush, sys.argv[1]

    def held(self):
        open(marker, "w").close()
        time.sleep(60)
        flush(self)

    write.ShardWriter.flush = held
    sys.argv = ["qerl.quantize", *sys.argv[2:]]
    runpy.run_module("qerl.quantize", run_name="__main__")
""")


def test_quantizer_interrupted_leaves_no_output(checkpoints, tmp_path, caplog):
    """SIGTERM midway: the work folder is removed on the way out, the output never appears, one line says why.
    SIGKILL midway: the work folder stays (nothing runs after SIGKILL) and the next run removes it, saying so."""
    bf16_dir, _ = checkpoints
    children = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        folder = tmp_path / sig.name
        folder.mkdir()
        children[sig] = start(QUANTIZE_HARNESS, folder / "held", "--model", bf16_dir, "--output", folder / "out")
    for sig, child in children.items():  # both held at once: their imports overlap
        wait_for(tmp_path / sig.name / "held", child)
        child.send_signal(sig)
    _, stderr = children[signal.SIGTERM].communicate(timeout=120)
    assert children[signal.SIGTERM].returncode == 128 + signal.SIGTERM
    assert_interrupted(stderr, "qerl.quantize", "SIGTERM")
    assert sorted(p.name for p in (tmp_path / "SIGTERM").iterdir()) == ["held"]

    killed = children[signal.SIGKILL]
    killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    partial = tmp_path / "SIGKILL" / f".out.partial-{killed.pid}"
    assert sorted(p.name for p in (tmp_path / "SIGKILL").iterdir()) == [partial.name, "held"]
    before = snapshot(Path(bf16_dir))
    assert (
        cli.run_cli(
            quantize.main, "qerl.quantize", ["--model", bf16_dir, "--output", str(tmp_path / "SIGKILL" / "out")]
        )
        == 0
    )
    assert any(f"removed {partial}" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in (tmp_path / "SIGKILL").iterdir()) == ["held", "out"]
    assert snapshot(Path(bf16_dir)) == before
