"""`python -m qerl.demo` (qerl/demo.py) end to end at toy length, on its own tiny model and on a real model folder (a
GGUF converted by qerl.models)."""

import json
import os
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml


@pytest.fixture
def torch_threads():
    """The demo sets torch's thread count for its process: put the test process's back afterwards."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_demo_takes_the_recipes_dapo_settings(tmp_path):
    """The demo's DAPO loss, LoRA and AQN settings are those of configs/parts/dapo.yaml as the file says now: a change
    to the part reaches the demo."""
    from qerl import demo

    part = yaml.safe_load((Path(__file__).parents[2] / "configs" / "parts" / "dapo.yaml").read_text())
    assert {"loss_type", "beta", "epsilon_high", "mask_truncated_completions"} <= set(demo.FROM_DAPO_PART)
    args = SimpleNamespace(output_dir=str(tmp_path), rl_steps=1, learning_rate=1e-3, seed=0, rollout_backend="auto")
    config = demo.rl_config(args, cuda=False)
    assert {name: getattr(config, name) for name in demo.FROM_DAPO_PART} == {
        name: part[name] for name in demo.FROM_DAPO_PART
    }


def test_a_real_model_runs_at_the_smollm2_recipes_batch_and_length(tmp_path):
    from qerl import demo

    recipe = yaml.safe_load(demo.REAL_MODEL_RECIPE.read_text())
    args = SimpleNamespace(output_dir=str(tmp_path), rl_steps=1, learning_rate=1e-3, seed=0, rollout_backend="auto")
    config = demo.real_model_config(args, cuda=False)
    assert {name: getattr(config, name) for name in demo.FROM_REAL_MODEL_RECIPE} == {
        name: recipe[name] for name in demo.FROM_REAL_MODEL_RECIPE
    }


def test_demo_pipeline(tmp_path, torch_threads):
    """`make demo` end to end at toy length: warm-up, NVFP4 quantization, QeRL, metrics and plot."""
    from qerl import demo, plotting

    summary = demo.main(["--output-dir", str(tmp_path), "--warmup-steps", "20", "--rl-steps", "10", "--problems", "8"])
    assert summary["cpu_threads"] == 1  # the toy's matrices are too small to share out between threads
    rows = plotting.read_metrics(summary["metrics"])
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert os.path.getsize(summary["plot"]) > 10_000
    assert os.path.isfile(os.path.join(tmp_path, "checkpoints", "nvfp4", "config.json"))
    # The saved adapter evaluates with the command the demo prints (on 16 problems, on the CPU).
    from eval import gsm8k
    from qerl import cli

    out = tmp_path / "eval.jsonl"
    argv = shlex.split(summary["eval"])[3:] + ["--limit", "16", "--device", "cpu", "--out", str(out)]
    assert cli.run_cli(gsm8k.main, "eval.gsm8k", argv) == 0
    result = json.loads(out.read_text().splitlines()[0])
    samples = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert result["examples"] == len(samples) == 16  # the summary is the share of the per-sample verdicts
    assert result["accuracy"] == sum(s["correct"] for s in samples) / 16
    # A second run into the same folder (the demo's trainer logs through JsonlMetrics) starts a new metrics file
    # and keeps the first aside.
    from transformers import TrainerState

    from qerl.callbacks import JsonlMetrics

    JsonlMetrics(summary["metrics"]).on_train_begin(None, TrainerState(), None)
    assert os.path.getsize(summary["metrics"]) == 0
    assert len(plotting.read_metrics(summary["metrics"].replace("metrics.jsonl", "metrics.1.jsonl"))) == 10


def test_demo_takes_a_real_model(converted, tmp_path, torch_threads):
    """`python -m qerl.demo --model ...` on a model folder: quantized into --checkpoint-dir, one RL step on the shipped
    GSM8K rows with the gsm8k_lenient rewards, then the adapter, metrics and plot."""
    from qerl import demo

    summary = demo.main(
        [
            "--model",
            str(converted),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--output-dir",
            str(tmp_path / "demo"),
            "--rl-steps",
            "1",
        ]
    )
    assert summary["base"] == str((tmp_path / "ckpt" / "bf16-nvfp4").resolve())
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1] and "rewards/gsm8k_final_answer_reward/mean" in rows[0]
    assert Path(summary["plot"]).stat().st_size > 0 and (Path(summary["adapter"]) / "adapter_config.json").is_file()
    # The eval command it prints parses with eval.gsm8k's own flags, and names files that exist.
    from eval.cli import build_parser
    from eval.gsm8k import BENCHMARK

    args = build_parser(BENCHMARK, "").parse_args(shlex.split(summary["eval"])[3:])
    assert Path(args.data).is_file() and Path(args.model).is_dir() and Path(args.adapter).is_dir()
