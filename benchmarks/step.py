r"""QeRL training on one GPU, timed: rollout throughput on the trainer's own path, and whole GRPO steps.

    python -m benchmarks.step --size 7b --precision nvfp4 --rollout-backend vllm --steps 3 --out runs/step.json
    python -m benchmarks.step --model ckpt/qwen2.5-coder-1.5b-instruct-nvfp4 \
        --config configs/qwen2.5_coder_1.5b_gsm8k_hash.yaml --rollout-backend native --steps 22 --rollout-batches ""

Builds a Qwen2.5-shaped model with random weights (no download) and writes it as a BF16 checkpoint, or as the
NVFP4 checkpoint our quantizer makes (kept under --workdir, reused by later runs). The trainer is the real one
(`qerl.train.build_trainer` on a recipe YAML) on real GSM8K questions; the tokenizer is the tiny character
tokenizer of the demo padded to the model's vocabulary, so a GSM8K prompt is ~250 tokens, near the recipe's
256. Random weights almost never sample EOS, so every completion runs to the length limit.
--model runs a real checkpoint instead (BF16 or NVFP4, its own tokenizer) on the recipe as written (its prompt
format, limits and masking): completions end where the model ends them, and each step's line gives its longest and
mean completion, since a step's time follows its longest.

1. Rollout throughput: `trainer.rollout.generate` (LoRA push, AQN, sampling: what a training round runs) on
   --rollout-batches prompts of the training set, --rollout-tokens new tokens each.
2. --steps optimizer steps of the recipe (LoRA r16, trainable norms, DAPO, gradient checkpointing), timed as
   benchmarks.trl_baseline times TRL's (one synchronisation at each step's start and end, nothing inside); with
   --phases each step is also split into rollout (of which LoRA push), log-prob forwards, backward and the rest
   (rewards, optimizer, logging), which synchronises at every phase boundary (those step times are not comparable
   with TRL's).
Peak GPU memory is torch's (the trainer) plus what vLLM holds, read from the driver.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.launch import GSM8K_SAMPLE
from benchmarks.random_models import QWEN25, build, padded_tokenizer
from benchmarks.rollout import max_new_tokens
from qerl import data, train
from qerl.field_rules import ROLLOUT_BACKENDS
from qerl.recipes import load_recipe


def wrap_phases(timer, trainer) -> None:
    """Time the step's phases (benchmarks.step_profile.PhaseTimer: synchronised at every boundary)."""
    backend = trainer.rollout
    timer.wrap(backend, "generate", "rollout")
    if backend.name == "vllm":
        timer.wrap(backend.engine, "load_lora", "lora push")
        timer.wrap(backend.engine, "load_norms", "lora push")
        timer.wrap(backend.engine, "generate", "sampling")  # ends before the engine sleeps: its peak memory
    elif backend.name == "native":
        timer.wrap(backend.engine.decoder, "refresh", "lora push")  # LoRA and norms into the engine's buffers
        timer.wrap(backend.engine, "generate", "sampling")
    timer.wrap(trainer, "_get_per_token_logps_and_entropies", "log-prob forwards")
    timer.wrap(trainer.accelerator, "backward", "backward")


def checkpoint_folder(size: str, precision: str, workdir: Path) -> Path:
    """Where `checkpoint` writes the random model of `size` and `precision` (what rollout servers load)."""
    return workdir / f"qwen2.5-{size}-random-{precision}"


def checkpoint(size: str, precision: str, workdir: Path) -> str:
    folder = checkpoint_folder(size, precision, workdir)
    if (folder / "config.json").is_file():
        return str(folder)
    import torch

    from qerl.nvfp4.checkpoint import save_nvfp4_checkpoint
    from qerl.nvfp4.quantize import quantize_model

    torch.manual_seed(0)
    model = build(size)
    model.config.eos_token_id = model.generation_config.eos_token_id = 2  # the tiny tokenizer's <|end|>
    tokenizer = padded_tokenizer(model.config.vocab_size)
    if precision == "bf16":
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    else:
        save_nvfp4_checkpoint(quantize_model(model), folder, tokenizer=tokenizer)
    del model
    torch.cuda.empty_cache()
    return str(folder)


def in_memory_model(size: str, precision: str, workdir: Path):
    """The random model built on the GPU (NVFP4 layer by layer: no checkpoint written) and a folder holding only the
    padded tokenizer, for --model-name."""
    model = build(size, precision)
    folder = workdir / f"tokenizer-{model.config.vocab_size}"
    padded_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return model, str(folder)


def recipe_flags(config: str, model_path: str, out_dir: Path, new_tokens: int) -> list[str]:
    """qerl.train flags of a recipe run on random weights and the character tokenizer (no saving, no logging)."""
    return [
        "--config",
        config,
        "--model-name",
        model_path,
        "--dataset",
        str(GSM8K_SAMPLE),
        "--output-dir",
        str(out_dir),
        "--max-completion-length",
        str(new_tokens),
        "--optim",
        "adamw_torch",
        "--save-strategy",
        "no",
        "--report-to",
        "none",
        "--metrics-jsonl",
        "false",
        # The character tokenizer makes ~4x more tokens than Qwen's: the system-prompt format would not fit the
        # recipe's 256-token prompts, the reference's first format (question + "####" instruction) mostly does.
        "--dataset-format",
        "gsm8k_hash",
        "--max-prompt-length",
        "320",
    ]


def real_model_flags(config: str, model_path: str, out_dir: Path, dataset: str) -> list[str]:
    """qerl.train flags of a recipe run as written on a real checkpoint (no saving, no logging), its prompts read from
    the local file `dataset` in the format of the recipe's own dataset (the GPU machine reaches no hub)."""
    recipe = load_recipe(config, train.build_parser())
    source = data.HUB_DATASETS.get(recipe.get("dataset"))
    return [
        "--config", config, "--model-name", model_path, "--dataset", dataset, "--output-dir", str(out_dir),
        *(["--dataset-format", source.format] if source else []),
        "--save-strategy", "no", "--report-to", "none", "--metrics-jsonl", "false",
    ]  # fmt: skip


def completion_lengths(log_history: list[dict]) -> list[tuple[float, float]]:
    """(longest, mean) completion tokens of each logged step, as TRL logs them."""
    return [
        (row["completions/max_length"], row["completions/mean_length"])
        for row in log_history
        if "completions/max_length" in row
    ]


def print_steps(seconds: list[float], lengths: list[tuple[float, float]]) -> float:
    """Each step's seconds with its longest and mean completion; returns the median of the steps after the first
    (compilation, graph capture, autotuning)."""
    print(f"{'step':>4s} {'s':>6s} {'longest':>7s} {'mean':>6s}   (completion tokens)")
    for i, step in enumerate(seconds):
        longest, mean = lengths[i] if i < len(lengths) else (float("nan"), float("nan"))
        print(f"{i + 1:4d} {step:6.2f} {longest:7.0f} {mean:6.1f}")
    median = statistics.median(seconds[1:] or seconds)
    print(f"median of steps 2-{len(seconds)}: {median:.2f} s")
    return median


def profile_steps(trainer, args, rollout_rows) -> None:
    """--profile: the steps split by phase, GPU time and kernels per phase, forwards per update, MFU."""
    import torch

    from benchmarks.step_profile import StepProfile, print_summary

    if args.steps < args.warmup_steps + 2:
        raise SystemExit(
            f"--profile needs --steps >= --warmup-steps + 2 = {args.warmup_steps + 2} (the warm-up steps "
            "and the profiled last step are not averaged)"
        )
    profiler = StepProfile(trainer, profile_step=args.steps - 1)
    trainer.add_callback(profiler)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    summary = profiler.summary(slice(args.warmup_steps, args.steps - 1))
    summary["torch_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    summary["completion_lengths"] = completion_lengths(trainer.state.log_history)
    summary["dense_weight_rounds"] = trainer.dense_weights.rounds
    print(f"\n{describe(args)}, rollout backend {trainer.rollout.name}, recipe {args.config or 'default'}")
    print_summary(summary)
    print(f"trainer's torch peak {summary['torch_peak_gib']:.1f} GiB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rollout": rollout_rows, "profile": summary}, indent=2))


def describe(args) -> str:
    if args.model:
        return f"{args.model} (real weights), completions as the model ends them"
    return f"Qwen2.5-{args.size} shapes, random weights, {args.precision}, completions <= {args.new_tokens} tokens"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=None,
        help="a real checkpoint folder (BF16 or NVFP4, with its tokenizer) instead of random weights: the recipe "
        "(--config, required) runs as written; --size, --precision, --new-tokens and --in-memory do not apply",
    )
    parser.add_argument(
        "--dataset", default=str(GSM8K_SAMPLE), help="--model: the training prompts (default: GSM8K rows)"
    )
    parser.add_argument("--size", choices=sorted(QWEN25), default="7b")
    parser.add_argument("--precision", choices=("nvfp4", "bf16"), default="nvfp4")
    parser.add_argument(
        "--rollout-backend", choices=ROLLOUT_BACKENDS, default="auto", help="rollout engine, as qerl.train's"
    )
    parser.add_argument("--config", default=None, help="recipe YAML (default: configs/dapo_gsm8k_<precision>.yaml)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=2048, help="max completion length of the steps")
    parser.add_argument("--rollout-batches", default="8,64")
    parser.add_argument("--rollout-tokens", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="build the random model on the GPU instead of writing a checkpoint (not for vllm)",
    )
    parser.add_argument(
        "--write-checkpoint",
        action="store_true",
        help="only write the random checkpoint of --size and --precision under --workdir (what rollout servers load "
        "before a run on it) and print its folder",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="split each step into its phases (a GPU synchronisation at every boundary, which the step times then "
        "include)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="split each step into every phase (benchmarks/step_profile.py); the last step also runs "
        "under torch.profiler; the first and the last are left out of the means",
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        help="--profile: steps left out of the means at the start (compilation, graph capture); with "
        "steps_per_generation > 1, a whole round, so that the means hold one round's share of "
        "generation and old log-probs",
    )
    parser.add_argument("--workdir", default="/tmp/qerl-bench")
    parser.add_argument("--out", default="runs/step.json")
    parser.add_argument("extra", nargs="*", help="more qerl.train flags")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.step_profile import PhaseTimer, StepClock, gpu_used_gib
    from qerl.rollout import no_noise

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.step needs a CUDA GPU")
    if args.write_checkpoint:
        print(checkpoint(args.size, args.precision, Path(args.workdir)))
        return

    model = None
    if args.model:
        if not args.config:
            raise SystemExit("--model needs --config: the recipe to run as written")
        out_dir = Path(args.workdir) / f"run-{Path(args.model).name}-{args.rollout_backend}"
        flags = real_model_flags(args.config, args.model, out_dir, args.dataset)
    else:
        if args.in_memory:
            model, model_path = in_memory_model(args.size, args.precision, Path(args.workdir))
        else:
            model_path = checkpoint(args.size, args.precision, Path(args.workdir))
        recipe = args.config or f"configs/dapo_gsm8k_{args.precision}.yaml"
        out_dir = Path(args.workdir) / f"run-{args.size}-{args.precision}-{args.rollout_backend}"
        # Random weights never sample EOS: with the recipe's masking every completion would drop out of the loss.
        flags = [*recipe_flags(recipe, model_path, out_dir, args.new_tokens), "--mask-truncated-completions", "false"]
    flags += [
        "--rollout-backend", args.rollout_backend, "--max-steps", str(args.steps),
        "--vllm-gpu-memory-utilization", str(args.gpu_memory_utilization),
        *args.extra,
    ]  # fmt: skip
    timer = PhaseTimer()
    trainer = train.build_trainer(*train.parse_args(flags), model=model)
    backend = trainer.rollout
    prompts = [
        trainer.processing_class.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
        for row in trainer.train_dataset.select(range(min(64, len(trainer.train_dataset))))
    ]

    rollout_rows = []
    for batch in [int(b) for b in args.rollout_batches.split(",") if b]:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        with max_new_tokens(backend, args.rollout_tokens):
            backend.generate(batch_prompts[:2], no_noise)  # warm-up: CUDA graphs, first LoRA push
            with timer.phase("bench rollout"):
                start = time.perf_counter()
                out = backend.generate(batch_prompts, no_noise)
                seconds = time.perf_counter() - start
        tokens = sum(len(c) for c in out.completion_ids)
        rollout_rows.append(
            {
                "batch": batch,
                "new_tokens": args.rollout_tokens,
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
            }
        )

    if args.profile:
        profile_steps(trainer, args, rollout_rows)
        return
    timer.total.clear()
    if args.phases:
        wrap_phases(timer, trainer)
    clock = StepClock()
    step_times = clock.times
    trainer.add_callback(clock)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    phases = {k: v / len(step_times) for k, v in timer.total.items()}
    if args.phases:
        nested = ("lora push", "sampling")  # parts of the rollout
        phases["other"] = sum(step_times) / len(step_times) - sum(v for k, v in phases.items() if k not in nested)
    mismatch = [
        row["sampling/sampling_logp_difference/mean"]
        for row in trainer.state.log_history
        if "sampling/sampling_logp_difference/mean" in row
    ]

    device = torch.cuda.get_device_name()
    lengths = completion_lengths(trainer.state.log_history)
    print(f"\n{describe(args)}, rollout backend {backend.name}, {device}")
    if rollout_rows:
        print(f"{'batch':>5s} {'new tok':>7s} {'tok/s':>8s}")
    for row in rollout_rows:
        print(f"{row['batch']:5d} {row['new_tokens']:7d} {row['tokens_per_s']:8.0f}")
    median = print_steps(step_times, lengths)
    for name, seconds in phases.items():
        print(f"  {name:18s} {seconds:7.2f} s/step")
    peak = {
        "torch_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu_peak_gib": max(timer.peak_gpu_gib, gpu_used_gib()),  # without --phases: read at the end only
    }
    print(
        f"{'peak GPU memory' if args.phases else 'GPU memory at the end'}: {peak['gpu_peak_gib']:.1f} GiB in use "
        f"(driver, all of it), trainer's torch peak {peak['torch_peak_gib']:.1f} GiB"
    )
    # TRL logs None for a step whose metric list came back empty (all NaN): say so rather than crash after the run
    print(
        "rollout vs trainer log-prob |difference| per step: "
        + ", ".join("n/a" if m is None else f"{m:.4f}" for m in mismatch)
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "device": device,
                "rollout": rollout_rows,
                "step_seconds": step_times,
                "completion_lengths": lengths,
                "median_step_seconds": median,
                "dense_weight_rounds": trainer.dense_weights.rounds,
                "phases_per_step": phases,
                "memory": peak,
                "logp_difference": mismatch,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
