"""benchmarks.trl_baseline: plain TRL on a QeRL recipe. The recipe reaches TRL's config field for field, and the
whole run (prompts, rewards, LoRA, the step clock, the per-step lengths) works end to end on the CPU, without vLLM."""

import dataclasses
import json
import os

from trl import GRPOConfig

from benchmarks import trl_baseline
from benchmarks.launch import REPO
from qerl import train

RECIPE = os.path.join(REPO, "configs", "qwen2.5_coder_1.5b_gsm8k_hash.yaml")
TOY = ["--max-prompt-length", "600", "--max-completion-length", "8", "--soft-overlong-cache", "4",
       "--per-device-train-batch-size", "8", "--num-generations", "4", "--gradient-accumulation-steps", "1",
       "--use-cpu", "true"]  # fmt: skip


def test_the_recipe_reaches_trls_config_field_for_field(checkpoints, tmp_path):
    bf16_dir, _ = checkpoints
    flags = ["--config", RECIPE, "--model-name", bf16_dir, "--output-dir", str(tmp_path), "--use-cpu", "true"]
    _, config = train.parse_args(flags)
    trl = trl_baseline.trl_config(config, gpu_memory_utilization=0.25)
    assert trl.use_vllm and trl.vllm_mode == "colocate" and trl.vllm_gpu_memory_utilization == 0.25
    assert not trl.vllm_enable_sleep_mode  # TRL's default; QeRL's own is on
    for name in ("learning_rate", "loss_type", "beta", "epsilon_high", "mask_truncated_completions", "temperature",
                 "max_completion_length", "num_generations", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "gradient_checkpointing", "optim", "max_grad_norm", "seed",
                 "generation_batch_size", "steps_per_generation"):  # fmt: skip
        assert getattr(trl, name) == getattr(config, name), name
    assert (trl.learning_rate, trl.loss_type, trl.epsilon_high, trl.max_completion_length) == (3e-4, "dapo", 0.28, 512)
    differ = [f.name for f in dataclasses.fields(GRPOConfig) if getattr(trl, f.name) != getattr(config, f.name)]
    assert set(differ) <= {"use_vllm", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "logging_dir"}, differ


def test_a_cpu_run_without_vllm_times_each_step_with_its_lengths(checkpoints, tmp_path, capsys):
    bf16_dir, _ = checkpoints
    out = tmp_path / "trl.json"
    result = trl_baseline.main(
        [
            "--model",
            bf16_dir,
            "--config",
            RECIPE,
            "--steps",
            "2",
            "--no-vllm",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path),
            "--",
            *TOY,
        ]  # fmt: skip
    )
    assert json.loads(out.read_text())["step_seconds"] == result["step_seconds"]
    assert len(result["step_seconds"]) == 2 and all(s > 0 for s in result["step_seconds"])
    assert len(result["completion_lengths"]) == 2
    assert all(1 <= mean <= longest <= 8 for longest, mean in result["completion_lengths"])
    printed = capsys.readouterr().out
    assert "TRL GRPOTrainer + peft LoRA" in printed and "median of steps 2-2" in printed
