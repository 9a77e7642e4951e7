"""The in-process worker of benchmarks.multi_gpu: one process of one `accelerate launch`, started by the driver as
`python -m benchmarks.multi_gpu --worker ...`. It builds the real trainer (qerl.train.build_trainer on the recipe of
the checkpoint's precision), times each optimizer step and its phases, profiles the last step's collectives, hashes
the trainable tensors and the prompts each round sampled, and the main process writes every rank's record to --result.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from benchmarks.launch import GSM8K_SAMPLE, REPO

DEEPSPEED_CONFIGS = ("zero2", "zero3")
# Prompts longer than this many tokens of the character tokenizer are dropped: at 320 (benchmarks.step's cap) only 2 of
# the sample's 256 GSM8K questions fit, too few for 4 ranks (TRL then finds no batch and trains 0 steps); 69 fit here.
MAX_PROMPT_TOKENS = 400


def _worker_flags(args) -> list[str]:
    from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint

    precision = "nvfp4" if is_nvfp4_checkpoint(args.model) else "bf16"
    flags = [
        "--config", str(REPO / "configs" / f"dapo_gsm8k_{precision}.yaml"), "--model-name", args.model,
        "--dataset", str(GSM8K_SAMPLE), "--dataset-format", "gsm8k_hash", "--max-prompt-length", str(MAX_PROMPT_TOKENS),
        "--output-dir", args.run_dir, "--rollout-backend", args.rollout_backend,
        "--max-completion-length", str(args.new_tokens), "--per-device-train-batch-size", str(args.batch),
        "--num-generations", str(args.batch),
        "--gradient-accumulation-steps", "1", "--max-steps", str(args.steps), "--optim", "adamw_torch",
        "--save-strategy", "no", "--report-to", "none", "--metrics-jsonl", "false", "--logging-steps", "1",
        # Random weights rarely sample EOS: with the recipe's masking every completion would drop out of the loss.
        "--mask-truncated-completions", "false",
    ]  # fmt: skip
    if args.dry_run:
        # DeepSpeed runs on the CPU when accelerate is not told to use it and the processes talk gloo.
        deepspeed = args.config in DEEPSPEED_CONFIGS
        cpu = ["--use-cpu", "False", "--ddp-backend", "gloo"] if deepspeed else ["--use-cpu", "True"]
        flags += ["--dtype", "float32", "--bf16", "false", "--gradient-checkpointing", "false", *cpu]
    return flags


def _comm_seconds(profiler) -> float:
    """Time of the collectives a profile recorded: NCCL kernels on the GPU, gloo's calls on the CPU."""
    import torch

    events = profiler.key_averages()
    if torch.cuda.is_available():
        return sum(e.self_device_time_total for e in events if "nccl" in e.key.lower()) / 1e6
    return sum(e.cpu_time_total for e in events if e.key.startswith("gloo:")) / 1e6


def _steps_callback(timer, profile_last: bool):
    from benchmarks.step import StepClock

    class Steps(StepClock):
        """Per optimizer step: wall time and each phase's time inside it; in the last step, the collectives' time
        from the end of its rollout on (the profiler stays out of the engine's CUDA-graph captures)."""

        def __init__(self):
            super().__init__()
            self.phases: list[dict[str, float]] = []
            self.comm = None
            self._profile_next = False
            self._profiler = None

        def on_step_begin(self, args, state, control, **kwargs):
            self._profile_next = profile_last and state.global_step == state.max_steps - 1
            self._before = dict(timer.total)
            super().on_step_begin(args, state, control, **kwargs)

        def rollout_done(self):
            if not self._profile_next:
                return
            import torch
            from torch.profiler import ProfilerActivity, profile

            self._profile_next = False
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            super().on_step_end(args, state, control, **kwargs)
            self.phases.append({k: v - self._before.get(k, 0.0) for k, v in timer.total.items()})
            if self._profiler is not None:
                self._profiler.__exit__(None, None, None)
                self.comm = _comm_seconds(self._profiler)
                self._profiler = None

    return Steps()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.step import PhaseTimer
    from qerl import sharding, train

    trainer = train.build_trainer(*train.parse_args(_worker_flags(args)))
    backend = trainer.rollout
    timer = PhaseTimer()
    steps = _steps_callback(timer, profile_last=not args.no_profile and args.steps >= 3)
    trainer.add_callback(steps)
    rounds: list[str] = []  # per generation round, a hash of the prompts this rank sampled
    timer.wrap(backend, "generate", "rollout")
    generate = backend.generate

    def recording(prompt_ids, perturb):
        rounds.append(hashlib.sha256(repr(sorted({tuple(p) for p in prompt_ids})).encode()).hexdigest()[:16])
        output = generate(prompt_ids, perturb)
        steps.rollout_done()
        return output

    backend.generate = recording
    if backend.name == "native":
        timer.wrap(backend.engine.decoder, "refresh", "refresh")
    timer.wrap(trainer, "_get_per_token_logps_and_entropies", "log-prob forwards")
    timer.wrap(trainer.accelerator, "backward", "backward")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()

    digest = hashlib.sha256()
    with trainer._open_policy() as model:  # ZeRO-3: gathered; FSDP2: resharded, then all-gathered tensor by tensor
        for name, param in model.named_parameters():
            if param.requires_grad:
                digest.update(name.encode())
                digest.update(sharding.whole(param.detach()).float().cpu().numpy().tobytes())
    cuda = torch.cuda.is_available()
    mine = {
        "rank": trainer.accelerator.process_index, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "backend": backend.name, "sharding": backend.setup.sharding,
        "step_seconds": steps.times, "phases": steps.phases, "comm_seconds": steps.comm,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_driver_gib": timer.peak_gpu_gib if cuda else None, "adapters": digest.hexdigest(), "rounds": rounds,
    }  # fmt: skip
    ranks = [mine]
    if dist.is_available() and dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if trainer.accelerator.is_main_process:
        Path(args.result).write_text(json.dumps(ranks))
