"""The anchor: plain TRL GRPOTrainer, vLLM colocate and a peft LoRA on a BF16 base, on a QeRL recipe, timed per step.

    python -m benchmarks.trl_baseline --model ckpt/qwen2.5-coder-1.5b-instruct \\
        --config configs/qwen2.5_coder_1.5b_gsm8k_hash.yaml --steps 22

What it shares with `python -m benchmarks.step --model ... --config ...` (and `python -m qerl.train`) on the same
recipe: every GRPOConfig field the recipe sets (loss, batch, lengths, optimizer, schedule, sampling, seed), the
prompts (qerl.data: the same task, format and length filter), the reward functions and the LoRA (lora.lora_config:
rank, alpha, targets, trainable norms). What is TRL's own: the trainer, its colocated vLLM engine (the adapter merged
into the weights and pushed every step), its padded training forwards, TRL's vLLM defaults (no sleep mode). No AQN
(TRL has none) and a BF16 base only (TRL's vLLM path merges the adapter into the base, which NVFP4 cannot take).
vLLM, trl and math-verify come from ../shared/gpu-site on the GPU machine (its README). --no-vllm generates with
TRL's transformers path instead: a smoke run of the wiring on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.launch import GSM8K_SAMPLE
from benchmarks.rollout import free_share
from benchmarks.step import completion_lengths, print_steps, real_model_flags
from qerl import train

if TYPE_CHECKING:  # torch and TRL load after the flags are read
    from trl import GRPOConfig, GRPOTrainer

    from qerl.config import QeRLConfig

# Left to TRL: QeRLConfig's own default where TRL's differs (a field the recipes do not set), and the field that
# GRPOConfig derives from steps_per_generation (given both, it refuses).
LEFT_TO_TRL = ("vllm_enable_sleep_mode", "generation_batch_size")


def trl_config(config: QeRLConfig, gpu_memory_utilization: float | None) -> GRPOConfig:
    """The recipe's GRPOConfig: every field GRPOConfig declares, as the QeRL config holds it (but LEFT_TO_TRL), with
    TRL's colocated vLLM at that share of the card (None: no vLLM, TRL's transformers generate)."""
    from trl import GRPOConfig

    shared = {
        f.name: getattr(config, f.name) for f in dataclasses.fields(GRPOConfig) if f.init and f.name not in LEFT_TO_TRL
    }
    shared["use_vllm"] = gpu_memory_utilization is not None
    if shared["use_vllm"]:
        shared.update(vllm_mode="colocate", vllm_gpu_memory_utilization=gpu_memory_utilization)
    return GRPOConfig(**shared)


def build(args) -> GRPOTrainer:
    import torch
    from trl import GRPOTrainer

    from qerl import base_model, lora

    flags = real_model_flags(args.config, args.model, Path(args.workdir) / "trl-baseline", args.dataset)
    flags += ["--max-steps", str(args.steps), *args.extra]
    script_args, config = train.parse_args(flags)
    train.validate(script_args, config)
    tokenizer = base_model.load_tokenizer(script_args.model_name)
    model = base_model.load_base_model(script_args.model_name, "bf16", getattr(torch, script_args.dtype), config.device)
    prompts, reward_funcs = train.prompts_and_rewards(script_args, config, tokenizer)
    share = None if args.no_vllm else args.gpu_memory_utilization
    if not args.no_vllm and share is None:
        # Room for the training passes: the model again (its activations' and gradients' order of size) and 8 GiB.
        share = free_share(reserve_bytes=sum(p.numel() * p.element_size() for p in model.parameters()) + 8 * 2**30)
    adapter = lora.lora_config(
        model, config.lora_rank, config.lora_alpha, config.lora_target_modules, config.lora_dropout,
        config.trainable_norms,
    )  # fmt: skip
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=trl_config(config, share),
        train_dataset=prompts,
        processing_class=tokenizer,
        peft_config=adapter,
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a BF16 checkpoint folder with its tokenizer")
    parser.add_argument("--config", required=True, help="the QeRL recipe YAML to run with TRL")
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--dataset", default=str(GSM8K_SAMPLE), help="the training prompts (default: GSM8K rows)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's share of the card (default: sized from the free memory, leaving the training passes room)",
    )
    parser.add_argument("--no-vllm", action="store_true", help="TRL's transformers generate: a CPU smoke run")
    parser.add_argument("--workdir", default="/tmp/qerl-bench")
    parser.add_argument("--out", default="runs/trl_baseline.json")
    parser.add_argument("extra", nargs="*", help="more qerl.train flags (recipe fields)")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.step_profile import StepClock, gpu_used_gib

    trainer = build(args)
    clock = StepClock()
    trainer.add_callback(clock)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    steps, lengths = clock.times, completion_lengths(trainer.state.log_history)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {
        "args": vars(args),
        "device": device,
        "trl_vllm_gpu_memory_utilization": trainer.args.vllm_gpu_memory_utilization if trainer.use_vllm else None,
        "step_seconds": steps,
        "completion_lengths": lengths,
        "median_step_seconds": statistics.median(steps[1:] or steps),
        "gpu_used_gib_at_end": gpu_used_gib(),
    }
    engine = f"vLLM colocate, share {trainer.args.vllm_gpu_memory_utilization}" if trainer.use_vllm else "generate"
    print(f"\nTRL GRPOTrainer + peft LoRA on {args.model} (BF16), {engine}, recipe {args.config}, {device}")
    print_steps(steps, lengths)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
