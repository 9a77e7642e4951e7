"""The command-line convention every program follows (qerl/cli.py, run_cli): each CLI run as a real process (exit code
2, one line naming the culprit, no traceback, nothing touched), --debug's traceback, and the small helpers the CLIs'
checks use."""

import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from bad_input import E, T, assert_one_line_error, run_process
from clis import QUANTIZER, snapshot

from eval import gsm8k
from eval.statistics import wilson_interval
from qerl import cli
from qerl.errors import UsageError, nearest
from qerl.input_checks import FETCH_COMMAND
from qerl.run_dir import RunLock
from qerl.sniff import looks_like_path


def test_each_cli_as_a_process(world, tmp_path):
    """Trials through real processes, each class of bad input at least once: exit code 2, one line naming the
    culprit, no traceback, nothing touched; and a tokenizer whose EOS the generation config lacks, which an eval
    runs with, warning. The processes run side by side (most of their time is imports)."""
    lock = RunLock(world / "busy")  # another run, in progress: this process
    lock.acquire()
    before = snapshot(world)
    trials = [
        (["-m", "qerl.quantize", "--model", "parent/model", "--output", "parent", "--overwrite"], "qerl.quantize",
         "parent"),
        (["-m", "qerl.quantize", "--model", "truncated", "--output", "out"], "qerl.quantize",
         "truncated/model.safetensors"),
        ([str(QUANTIZER), "--model", "t5", "--output", "out"], "quantize_nvfp4", "T5ForConditionalGeneration"),
        (["-m", "qerl.train", *T, "--sigma-strat", "1"], "qerl.train", "did you mean --sigma-start?"),
        (["-m", "qerl.train", *T, "--output-dir", "run"], "qerl.train", "--resume-from-checkpoint true"),
        (["-m", "qerl.train", *T, "--num-generations", "0"], "qerl.train", "--num-generations must be an integer >= 2"),
        (["-m", "qerl.train", *T, "--model-name", "model.gguf"], "qerl.train", "GGUF", FETCH_COMMAND),
        (["-m", "qerl.train", *T, "--output-dir", "busy"], "qerl.train",
         f"--output-dir busy is in use by another run (process {os.getpid()} on {socket.gethostname()}"),
        (["-m", "eval.gsm8k", *E, "--adapter", "no_adapter"], "eval.gsm8k", "adapter_config.json"),
        (["-m", "eval.gsm8k", *E, "--adapter", "other_base"], "eval.gsm8k", "down_proj is [64, 128] (out, in)"),
        (["-m", "eval.competition_math", *E[:2], "--limit", "0"], "eval.competition_math", "--limit"),
        (["-m", "qerl.rollout_server", "--model", "parent", "--port", "8001", "--gpu-memory-utilization", "0.5"],
         "qerl.rollout_server", "--gpu-memory-utilization is a flag of --engine vllm", "runs --engine native"),
    ]  # fmt: skip
    warned = ["-m", "eval.gsm8k", "--model", "eos_elsewhere", "--data", "arithmetic", "--limit", "1", "--protocol",
              "greedy", "--max-new-tokens", "1", "--device", "cpu", "--out", str(tmp_path / "eos.jsonl")]  # fmt: skip
    try:
        with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            *results, eos = pool.map(lambda args: run_process(args, world), [t[0] for t in trials] + [warned])
        for (_, prog, *culprit), result in zip(trials, results, strict=True):
            assert_one_line_error(result.returncode, result.stderr, prog, *culprit)
        assert snapshot(world) == before
    finally:
        lock.release()
    assert eos.returncode == 0, eos.stderr
    assert (
        "the tokenizer's EOS '<|end|>' (id 2) is not among the generation config's EOS ids: '<|system|>' (id 3)"
        in eos.stderr
    )


def test_debug_shows_the_traceback_and_program_errors_keep_theirs(world, monkeypatch, capsys):
    monkeypatch.chdir(world)
    with pytest.raises(UsageError, match="no such folder"):
        cli.run_cli(gsm8k.main, "eval.gsm8k", ["--model", "./nope", "--debug"])
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(UsageError, match="no such folder"):
        cli.run_cli(gsm8k.main, "eval.gsm8k", ["--model", "./nope"])

    def buggy(argv):
        raise KeyError("a bug, not a user error")

    with pytest.raises(KeyError):
        cli.run_cli(buggy, "x", [])


def test_the_exit_code_is_mains_int_else_zero():
    """A main that returns what it made (the demo's summary, train's trainer) exits 0; an int is the code."""
    assert cli.run_cli(lambda argv: {"summary": 1}, "x", []) == 0
    assert cli.run_cli(lambda argv: None, "x", []) == 0
    assert cli.run_cli(lambda argv: 3, "x", []) == 3


def test_cli_helpers():
    assert cli.attach_negative_numbers(["--lr", "-1e-5", "--x", "-y"]) == ["--lr=-1e-5", "--x", "-y"]
    assert looks_like_path("./model") and looks_like_path("/abs/model") and looks_like_path("a/b/c")
    assert not looks_like_path("Qwen/Qwen2.5-7B-Instruct") and not looks_like_path("gpt2")
    assert nearest("--lora-rnak", ["--lora-rank", "--lora-alpha"]) == " (did you mean --lora-rank?)"
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and 0.27 < high < 0.29  # the rule of three, roughly
    assert torch.tensor(1.0)  # torch stays importable next to the CLI helpers
