"""What `python -m qerl.train` decides for the machine it runs on (train.fit_the_machine: no CUDA, no bitsandbytes,
no hub) and what a run says: one line per change or refusal, a line per logging step, and the eval command at the end
that runs as printed."""

import logging
import re
import shlex

import pytest
import torch
from bad_input import MAINS, T, assert_one_line_error
from fakes import train_argv

from qerl import cli, data, input_checks, train
from qerl.errors import UsageError

# ----------------------------------------------------------------------------------------------------------
# What the machine decides (train.fit_the_machine), and what a run says


def _fitted(monkeypatch, argv, cuda=False, bitsandbytes=False):
    """parse_args on a machine with or without CUDA and bitsandbytes."""
    import transformers.utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(transformers.utils, "is_bitsandbytes_available", lambda: bitsandbytes)
    return train.parse_args(argv)


def test_without_cuda_or_bitsandbytes_a_recipe_takes_what_runs_and_says_so(tmp_path, monkeypatch, caplog):
    """The recipes' bf16 and adamw_8bit on a machine with neither CUDA nor bitsandbytes: the CPU settings and torch's
    AdamW, each change in one line; what the flags give stays."""
    recipe = ["--config", "configs/dapo_gsm8k_nvfp4.yaml", "--model-name", "m", "--output-dir", str(tmp_path)]
    with caplog.at_level(logging.WARNING, logger="qerl.train"):
        script, config = _fitted(monkeypatch, recipe)
    assert (config.use_cpu, config.bf16, script.dtype, config.optim) == (True, False, "float32", "adamw_torch")
    assert [r.getMessage() for r in caplog.records] == [
        "training on the CPU (no CUDA device here): taking --use-cpu True --bf16 False --dtype float32 (give a flag "
        "to choose otherwise)",
        "bitsandbytes is not installed: taking --optim adamw_torch for the recipe's adamw_8bit (the same AdamW "
        "update, FP32 moments; pip install bitsandbytes for the 8-bit one)",
    ]
    caplog.clear()
    script, config = _fitted(monkeypatch, [*recipe, "--dtype", "bfloat16", "--use-cpu", "True"], bitsandbytes=True)
    assert (config.use_cpu, config.bf16, script.dtype, config.optim) == (True, False, "bfloat16", "adamw_8bit")
    assert [r.getMessage() for r in caplog.records] == [
        "training on the CPU (no CUDA device here): taking --bf16 False (give a flag to choose otherwise)"
    ]


def test_what_the_flags_ask_for_and_the_machine_cannot_do_is_one_line(world, monkeypatch, capsys):
    """--optim adamw_8bit given without bitsandbytes, and --bf16 True --use-cpu False without CUDA: one line naming
    the fix, not transformers' ImportError after the model load or its "assign use_cpu"."""
    import transformers.utils

    monkeypatch.chdir(world)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transformers.utils, "is_bitsandbytes_available", lambda: False)
    code = cli.run_cli(MAINS["qerl.train"], "qerl.train", [*T, "--optim", "adamw_8bit"])
    assert_one_line_error(
        code, capsys.readouterr().err, "qerl.train", "--optim adamw_8bit needs bitsandbytes", "--optim adamw_torch"
    )
    argv = [*T, "--use-cpu", "False", "--bf16", "True"]
    code = cli.run_cli(MAINS["qerl.train"], "qerl.train", argv)
    error = assert_one_line_error(code, capsys.readouterr().err, "qerl.train", "pass --use-cpu True or --bf16 False")
    assert "assign use_cpu" not in error


def test_the_bitsandbytes_optimizers_are_transformers():
    from transformers.trainer_optimizer import _BITSANDBYTES_OPTIMIZERS

    assert sorted(train.BITSANDBYTES_OPTIMIZERS) == sorted(name.value for name in _BITSANDBYTES_OPTIMIZERS)
    assert set(train.BITSANDBYTES_ADAMW) <= set(train.BITSANDBYTES_OPTIMIZERS)


def test_a_hub_dataset_out_of_reach_is_one_line_naming_the_clones_rows(world, tmp_path, monkeypatch, capsys):
    """--dataset gsm8k with HF_HUB_OFFLINE set (no request leaves the process) and nothing in the datasets cache: one
    line naming --dataset FILE and the GSM8K rows a clone carries, instead of datasets' retries and traceback; with
    the dataset cached, the check lets it load."""
    import datasets
    import huggingface_hub

    monkeypatch.chdir(world)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    code = cli.run_cli(MAINS["qerl.train"], "qerl.train", [*T, "--dataset", "gsm8k"])
    assert_one_line_error(
        code,
        capsys.readouterr().err,
        "qerl.train",
        "--dataset gsm8k: openai/gsm8k is on the Hugging Face hub, which is out of reach (HF_HUB_OFFLINE is set)",
        f"--dataset FILE (a local .jsonl / .json / .parquet / .csv file), such as the rows this clone carries: "
        f"--dataset {data.GSM8K_DATA / 'train_sample.jsonl'}",
    )
    (tmp_path / "cache" / "openai___gsm8k" / "main" / "0.0.0" / "0123abcd").mkdir(parents=True)
    input_checks.check_hub_dataset("openai/gsm8k", "--dataset", "gsm8k")


def test_a_hub_without_an_answer_is_named(tmp_path, monkeypatch):
    """No connection (a name that does not resolve, a timeout): the one line says so, with the endpoint."""
    import datasets
    import httpx
    from huggingface_hub import HfApi

    def unreachable(self, repo_id, timeout=None):
        assert timeout == input_checks.HUB_TIMEOUT
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "dataset_info", unreachable)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    with pytest.raises(UsageError, match=r"out of reach \(no answer from https://\S+ within 2 s: \[Errno -2\] Name or"):
        input_checks.check_hub_dataset("open-r1/DAPO-Math-17k-Processed", "--dataset", "dapomath")


def test_help_answers_and_a_run_is_one_line_without_trl(world, monkeypatch, capsys):
    """Where trl is not installed (importlib.metadata finds no distribution) --help still answers from the flag table
    and a run says in one line what to install, not PackageNotFoundError's traceback."""
    from importlib.metadata import PackageNotFoundError

    from qerl import recipes

    installed = recipes.version

    def version(name):
        if name == "trl":
            raise PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(recipes, "version", version)
    monkeypatch.chdir(world)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as done:
        cli.run_cli(MAINS["qerl.train"], "qerl.train", ["--help"])
    assert done.value.code == 0 and "--model-name" in capsys.readouterr().out
    code = cli.run_cli(MAINS["qerl.train"], "qerl.train", T)
    assert_one_line_error(code, capsys.readouterr().err, "qerl.train", "trl not installed", "make setup")


def test_a_run_says_each_step_and_ends_with_the_eval_command_that_runs_as_printed(
    checkpoints, tmp_path, monkeypatch, capsys, caplog
):
    """A line per logging step (step, reward, truncated share, step time) instead of the dict of every key; at the end
    the metrics, the plot, the adapter and the command that scores it, which runs as printed (here on the GSM8K test
    rows a clone carries, asked as the run trained: the "####" format)."""
    from eval import gsm8k

    monkeypatch.chdir(tmp_path)  # the eval's default output folder
    rows = str(data.GSM8K_DATA / "train_sample.jsonl")
    argv = train_argv(checkpoints[1], str(tmp_path / "run"), 2, "--dataset", rows, "--dataset-format", "gsm8k_lenient",
                      "--num-examples", "8", "--save-steps", "100")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="qerl.train"):
        assert cli.run_cli(MAINS["qerl.train"], "qerl.train", argv) == 0
    steps = [r.getMessage() for r in caplog.records if r.name == "qerl.train" and r.getMessage().startswith("step ")]
    assert [line.split()[:2] for line in steps] == [["step", "1/2"], ["step", "2/2"]]
    assert all(re.search(r"reward \d\.\d{3}  truncated +\d+%  .* \d+\.\d s/step", line) for line in steps), steps
    out = capsys.readouterr().out
    assert "{'loss'" not in out  # transformers' dict of the logged keys
    lines = out.splitlines()
    assert lines[-4:-1] == [
        f"metrics: {tmp_path / 'run' / 'metrics.jsonl'}",
        f"plot:    {tmp_path / 'run' / 'metrics.png'}",
        f"adapter: {tmp_path / 'run'} (on the base {checkpoints[1]}); evaluate it with",
    ]
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 10_000
    command = shlex.split(lines[-1])
    assert command[:3] == ["python", "-m", "eval.gsm8k"] and "gsm8k_hash" in command
    assert cli.run_cli(gsm8k.main, "eval.gsm8k", command[3:]) == 0
    assert "n=128); per sample: runs/eval/gsm8k-test_sample-greedy-" in capsys.readouterr().out
