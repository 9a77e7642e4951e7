"""The policy's training passes on an NVFP4 base vs a BF16 base, side by side, at the trainer's shapes.

    python -m benchmarks.train_pass --size 7b --micro-batches 2,4,8 --prompt 256 --completion 2048 --profile

Three passes of one micro-batch (rows = micro-batch x (prompt + completion)), each as the trainer runs it through
TRL's `_get_per_token_logps_and_entropies` on the real trainer (`qerl.train.build_trainer`, the recipe of each
precision: LoRA r16 on every projection + trainable norms, gradient checkpointing):
  log-prob forward   no gradients (the old / AQN-shift log-probs of a round)
  loss forward       with gradients, inside the trainer's attention-backend choice (training_step's)
  backward           of the mean log-prob (checkpointed layers recompute their forward here)
AQN is off on both so that both run the same passes. Both bases are Qwen2.5-shaped with random weights, built in
memory (NVFP4 quantized layer by layer); prompts are left-padded by up to half their length, so attention gets a
mask as in training. The precisions alternate `--repeats` times; medians are reported, and the NVFP4 speed as a
fraction of BF16's (BF16 time / NVFP4 time). `--profile` adds the CUDA time of one loss forward + backward of each
base by kernel family.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.rollout import kernel_family
from benchmarks.step import in_memory_model, recipe_flags
from qerl import train

if TYPE_CHECKING:  # torch and the trainer load after the flags are read
    import torch

PRECISIONS = ("nvfp4", "bf16")
PASSES = ("log-prob forward", "loss forward", "backward")
# Substring of a CUDA kernel's name -> family, first match wins.
KERNEL_FAMILIES = (
    ("_dequant_kernel", "NVFP4 dequant"), ("_gemm_tc_kernel", "NVFP4 fused GEMM"),
    ("nvfp4_decode_gemm", "NVFP4 fused GEMM"),
    ("fmha", "attention"), ("flash", "attention"), ("attention", "attention"), ("cudnn", "attention"),
    ("gemm", "GEMM (cuBLAS/CUTLASS)"), ("nvjet", "GEMM (cuBLAS/CUTLASS)"), ("splitKreduce", "GEMM (cuBLAS/CUTLASS)"),
    ("sm90_xmma", "GEMM (cuBLAS/CUTLASS)"), ("cutlass", "GEMM (cuBLAS/CUTLASS)"),
)  # fmt: skip


def make_trainer(size: str, precision: str, completion: int, workdir: Path):
    model, model_path = in_memory_model(size, precision, workdir)
    recipe = f"configs/dapo_gsm8k_{precision}.yaml"
    flags = [*recipe_flags(recipe, model_path, workdir / f"run-{precision}", completion),
             "--rollout-backend", "transformers", "--aqn", "false"]  # fmt: skip
    trainer = train.build_trainer(*train.parse_args(flags), model=model)
    trainer.model.train()
    if trainer.args.gradient_checkpointing:  # what Trainer.train() turns on before its first step
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
        )
    return trainer


def batch(vocab: int, micro_batch: int, prompt: int, completion: int, generator: torch.Generator):
    import torch

    ids = torch.randint(3, vocab, (micro_batch, prompt + completion), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(torch.randint(0, prompt // 2 + 1, (micro_batch,), generator=generator).tolist()):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids.cuda(), mask.cuda()


def sync_time() -> float:
    import torch

    torch.cuda.synchronize()
    return time.perf_counter()


def run_passes(trainer, ids, mask, completion: int) -> dict[str, float]:
    """Seconds of each pass on one micro-batch, and the memory the two with gradients add at their peak (GiB above
    what was allocated before them: both bases' weights, which every pass shares)."""
    import torch

    from qerl.trainer import TRAINING_SDPA_BACKENDS

    model = trainer.model
    size = ids.size(0)
    start = sync_time()
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(model, ids, mask, completion, size)
    forward_done = sync_time()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.nn.attention.sdpa_kernel(TRAINING_SDPA_BACKENDS):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, completion, size)
        loss_done = sync_time()
        logps.mean().backward()
        backward_done = sync_time()
    model.zero_grad(set_to_none=True)
    added = (torch.cuda.max_memory_allocated() - before) / 2**30
    return {
        "log-prob forward": forward_done - start,
        "loss forward": loss_done - forward_done,
        "backward": backward_done - loss_done,
        "peak_gib": added,
    }


def kernel_families(trainer, ids, mask, completion: int) -> dict[str, float]:
    """CUDA milliseconds by kernel family of one loss forward + backward."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from qerl.trainer import TRAINING_SDPA_BACKENDS

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.nn.attention.sdpa_kernel(TRAINING_SDPA_BACKENDS):
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, completion, ids.size(0))
            logps.mean().backward()
        torch.cuda.synchronize()
    trainer.model.zero_grad(set_to_none=True)
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[kernel_family(event.name, KERNEL_FAMILIES)] += event.device_time / 1e3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="7b", help="Qwen2.5 shape (benchmarks.random_models.QWEN25)")
    parser.add_argument("--micro-batches", default="2,4,8", help="completions per pass")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="CUDA time by kernel family at the first micro-batch")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/qerl-bench"))
    parser.add_argument("--out", type=Path, default=Path("runs/train_pass.json"))
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.train_pass needs a CUDA GPU")
    micro_batches = [int(m) for m in args.micro_batches.split(",")]

    trainers = {p: make_trainer(args.size, p, args.completion, args.workdir) for p in PRECISIONS}
    vocab = trainers["bf16"].model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    rows, profiles = [], {}
    for micro_batch in micro_batches:
        ids, mask = batch(vocab, micro_batch, args.prompt, args.completion, generator)
        for trainer in trainers.values():  # warm-up: kernels compiled and autotuned, allocator grown
            run_passes(trainer, ids, mask, args.completion)
        samples = {p: [] for p in PRECISIONS}
        for _ in range(args.repeats):
            for p in PRECISIONS:
                samples[p].append(run_passes(trainers[p], ids, mask, args.completion))
        row = {"micro_batch": micro_batch, "rows": ids.numel()}
        for p in PRECISIONS:
            for key in (*PASSES, "peak_gib"):
                row[f"{p} {key}"] = statistics.median(s[key] for s in samples[p])
        rows.append(row)
        if args.profile and micro_batch == micro_batches[0]:
            profiles = {p: kernel_families(trainers[p], ids, mask, args.completion) for p in PRECISIONS}

    device = torch.cuda.get_device_name()
    print(
        f"\nQwen2.5-{args.size} shapes, random weights, {device}, torch {torch.__version__}; seconds per pass "
        f"(median of {args.repeats}); NVFP4 speed = BF16 time / NVFP4 time"
    )
    header = f"{'rows':>6s} {'pass':18s} {'NVFP4 s':>8s} {'BF16 s':>8s} {'speed':>6s}"
    print(header)
    for row in rows:
        for key in PASSES:
            nv, bf = row[f"nvfp4 {key}"], row[f"bf16 {key}"]
            print(f"{row['rows']:6d} {key:18s} {nv:8.3f} {bf:8.3f} {bf / nv:5.2f}x")
        nv = row["nvfp4 loss forward"] + row["nvfp4 backward"]
        bf = row["bf16 loss forward"] + row["bf16 backward"]
        print(
            f"{row['rows']:6d} {'forward+backward':18s} {nv:8.3f} {bf:8.3f} {bf / nv:5.2f}x   GiB added at the "
            f"peak: NVFP4 {row['nvfp4 peak_gib']:.2f}, BF16 {row['bf16 peak_gib']:.2f}"
        )
    for p, families in profiles.items():
        print(
            f"{p}, one loss forward + backward at {rows[0]['rows']} rows, CUDA ms: "
            + ", ".join(f"{k} {v:.1f}" for k, v in families.items())
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "device": device, "rows": rows, "kernel_ms": profiles},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
