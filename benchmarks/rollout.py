r"""Rollout throughput of the backends side by side: native | transformers | vllm, NVFP4 and BF16, on one GPU.

    python -m benchmarks.rollout --rollout-backend native --size 7b --batches 8,64 --new-tokens 2048 [--profile]
    python -m benchmarks.rollout --rollout-backend vllm --size 7b --batches 8,64 --new-tokens 2048
    python -m benchmarks.rollout --rollout-backend native --size 14b --precisions nvfp4 --batches 8,32,64 \
        --kv-cache-dtypes auto,fp8
    python -m benchmarks.rollout --rollout-backend native --size qwen3-8b --batches 8 --new-tokens 2048   (or gemma3-4b)

Builds the model with random weights on the GPU (benchmarks/random_models.py; NVFP4: quantized layer by layer as
it is built, so a 32B model never exists in BF16), wraps it in a rank-16 LoRA on every projection (B random, so the
adapter is not zero) and samples through the rollout backend exactly as the trainer calls it (`RolloutSetup` ->
`generate`), at temperature 1, with `batch` random prompts of `prompt-len` tokens and no EOS (random weights almost
never sample one anyway). vllm gets the same model written as a checkpoint under --workdir.

Per row, after one untimed rollout of the same prompts and length (the timed shapes and KV capacity, so that nothing
compiles inside a timed call; a row names any Triton kernel that did): the median of --repeats timed rollouts, in
tokens/s of the whole batch and ms per decode step with its min-max, and for native the bytes floor of a decode step
(weights + LoRA + the valid KV of an average step, over the measured copy bandwidth) and the row's peak GPU memory.
--profile adds, for native, the GPU time per decode step by kernel family (an eager run of 40 more tokens minus
one of 8, so prefill cancels out), against the graph's measured step. It profiles at the timed run's average
context (prompt + new-tokens / 2), so attention weighs what it weighs on average over the run.
--kv-cache-dtypes (native) times each batch with each KV-cache dtype in turn on the same engine (auto: the
model's; fp8: E4M3 + scales, qerl/rollout/native/kv_cache.py) and reports the KV cache's size per wave.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.random_models import SIZES, build, padded_tokenizer, with_lora
from qerl.field_rules import KV_CACHE_DTYPES, ROLLOUT_BACKENDS

if TYPE_CHECKING:  # torch and the engines load after the flags are read
    import torch

    from qerl.rollout import RolloutSetup, VLLMSettings


@contextlib.contextmanager
def max_new_tokens(backend, n: int):
    """The backend samples up to `n` tokens inside the block (its settings: vLLM's params or a GenerationConfig)."""
    settings, key = (
        (backend.sampling, "max_tokens")
        if hasattr(backend, "sampling")
        else (backend.generation_config.__dict__, "max_new_tokens")
    )
    saved = settings[key]
    settings[key] = n
    try:
        yield
    finally:
        settings[key] = saved


def weights_gb(model) -> float:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(t.numel() * t.element_size() for t in tensors) / 1e9


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting read + write."""
    import torch

    src = torch.empty(2**30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 10 * 2 * src.numel() * 2 / (time.perf_counter() - start)


def decode_bytes(decoder, batch: int, prompt_len: int, new_tokens: int, kv_fp8: bool = False) -> float:
    """What one average decode step must read: frozen weights, LoRA buffers, norms, LM head, valid KV."""
    from qerl.rollout.native import kv_cache

    tensors = [decoder.lm_head]
    for p in decoder.projections():
        tensors += [p.packed, p.scale] if p.nvfp4 else [p.weight]
        tensors += [t for t in (p.lora_a, p.lora_b) if t is not None]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    kv_per_token = len(decoder.layers) * kv_cache.bytes_per_token(
        decoder.num_kv_heads, decoder.head_dim, decoder.embed.dtype, kv_fp8
    )
    return weights + batch * (prompt_len + new_tokens / 2) * kv_per_token


# Substring of the kernel name -> family, first match wins. The NVFP4 GEMM includes the LoRA adapter it computes in
# the same launch; the cuBLAS family is, on an NVFP4 base, the LM head alone.
KERNEL_FAMILIES = (
    ("_gemm_tc_kernel", "NVFP4 GEMM"),
    ("nvfp4_decode_gemm", "NVFP4 GEMM"),  # Triton's, the CUDA ones (before "gemm")
    ("nvfp4_wgmma_gemm", "NVFP4 GEMM"),
    ("_race_", "sampling"),  # the fused temperature sampler (before the attention's "_merge_kernel")
    ("_split_kernel", "attention"),
    ("_merge_kernel", "attention"),
    ("_rmsnorm", "add+RMSNorm"),
    ("_rope_cache", "rotary+KV write"),
    ("_gate_mul", "SiLU/GELU gate"),
    ("gemm", "cuBLAS GEMM (BF16 base, LoRA, LM head)"),
    ("gemv", "cuBLAS GEMM (BF16 base, LoRA, LM head)"),
    ("splitKreduce", "cuBLAS GEMM (BF16 base, LoRA, LM head)"),
    ("nvjet", "cuBLAS GEMM (BF16 base, LoRA, LM head)"),
    ("softmax", "sampling"),
    ("exponential", "sampling"),
    ("argmax", "sampling"),
    ("reduce", "sampling"),
)


def kernel_family(name: str, families=KERNEL_FAMILIES) -> str:
    """The family of the first (substring, family) pair whose substring is in the kernel's name, or "other"."""
    return next((family for key, family in families if key.lower() in name.lower()), "other")


def kernel_times(engine, prompts, new_tokens: int) -> dict[str, float]:
    """GPU microseconds per family of one eager generate."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.cuda_graphs
    engine.cuda_graphs = False
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, new_tokens)
            torch.cuda.synchronize()
    finally:
        engine.cuda_graphs = graphs
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[kernel_family(event.name)] += event.device_time
    return totals


def profile_decode_step(engine, prompts) -> dict[str, float]:
    """GPU microseconds per decode step, by kernel family: (eager 48 tokens) - (eager 8 tokens), over 40 steps."""
    kernel_times(engine, prompts, 8)  # warm-up
    short, long = kernel_times(engine, prompts, 8), kernel_times(engine, prompts, 48)
    return {k: (long[k] - short.get(k, 0.0)) / 40 for k in sorted(long, key=lambda k: -long[k])}


def free_share(reserve_bytes: int = 0) -> float:
    """vLLM's gpu_memory_utilization for the memory free now, less `reserve_bytes` kept for others: vLLM refuses to
    start unless that share of the whole card is free, so a fixed share fails beside a resident model (0.5 of an H200
    beside the BF16 7B and its copy). Three quarters of it: vLLM 0.26 captures its CUDA graphs outside the share (at
    0.9 of the free memory the 1.5B's capture ran out of memory on an H100)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return round(max(0.05, min(0.9, 0.75 * (free - reserve_bytes) / total)), 3)


def setup_for(model, new_tokens: int, model_path: str | None, vllm: VLLMSettings) -> RolloutSetup:
    """Temperature 1 and nothing else, no EOS: every sequence samples `new_tokens`."""
    from transformers import GenerationConfig

    from qerl.rollout import RolloutSetup

    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens)
    return RolloutSetup.for_model(model, config, [], 0, model_path=model_path, vllm=vllm)


def time_batch(
    args, backend, base, gb: float, precision: str, batch: int, gen: torch.Generator, kv_dtype: str = "auto"
) -> dict:
    """`args.repeats` timed rollouts of `batch` random prompts as a result row (median and spread), after one untimed
    rollout of the same prompts at the same length: the KV capacity, the CUDA graph's batch and every kernel's
    shapes are the timed ones, so nothing compiles inside a timed call (the row counts what did anyway)."""
    import torch

    from benchmarks.timing import compilations, spread
    from qerl.rollout import no_noise
    from qerl.rollout.native import kv_cache

    if args.rollout_backend == "native":
        backend.engine.kv_fp8 = kv_cache.resolve(kv_dtype)
    torch.cuda.reset_peak_memory_stats()
    prompts = torch.randint(10, base.config.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
    backend.generate(prompts, no_noise)  # warm-up, as long as the timed runs
    seconds = []
    with compilations() as compiled:
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = backend.generate(prompts, no_noise)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    tokens = sum(len(c) for c in out.completion_ids)
    steps = max(len(c) for c in out.completion_ids)
    ms = spread([1e3 * s / steps for s in seconds])
    row = {"engine": args.rollout_backend, "precision": precision, "batch": batch, "tokens": tokens,
           "seconds": seconds, "tokens_per_s": tokens / statistics.median(seconds), "ms_per_step": ms["median"],
           "ms_per_step_range": [ms["min"], ms["max"]], "repeats": args.repeats,
           "compiled_in_timed_runs": compiled.names if compiled.known else None, "weights_gb": gb,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
    if args.rollout_backend == "native":
        engine = backend.engine
        row["kv_cache"] = kv_dtype
        row["waves"] = engine.last_waves
        capacity = args.prompt_len + args.new_tokens
        row["kv_gib"] = engine._kv_bytes_per_sequence(capacity) * -(-batch // engine.last_waves) / 2**30
        row["floor_ms"] = (
            1e3 * decode_bytes(engine.decoder, batch, args.prompt_len, args.new_tokens, engine.kv_fp8) / args.bw
        )
        if args.profile:  # prompts as long as the timed run's average context
            context = args.prompt_len + args.new_tokens // 2
            mid_run = torch.randint(10, base.config.vocab_size, (batch, context), generator=gen).tolist()
            row["kernels_us_per_step"] = profile_decode_step(engine, mid_run)
    return row


def run(args, precision: str) -> list[dict]:
    import torch

    from qerl.rollout import VLLMSettings, create_backend

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = build(args.size, precision)
    gb = weights_gb(base)
    model_path = None
    if args.rollout_backend == "vllm":  # vLLM loads a folder: the same weights, written once per run
        from qerl.nvfp4.checkpoint import save_nvfp4_checkpoint

        folder = Path(args.workdir) / f"{args.size}-{precision}"
        tokenizer = padded_tokenizer(base.config.vocab_size)
        if precision == "nvfp4":
            save_nvfp4_checkpoint(base, folder, tokenizer=tokenizer, overwrite=True)
        else:
            base.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        model_path = str(folder)
    model = with_lora(base, args.lora_rank)
    vllm = VLLMSettings()
    if args.rollout_backend == "vllm":  # a share of what is free now, no sleep (nothing else runs between rounds)
        share = args.gpu_memory_utilization or free_share()
        vllm = VLLMSettings(gpu_memory_utilization=share, max_model_len=args.prompt_len + args.new_tokens, sleep=False)
    backend = create_backend(args.rollout_backend, setup_for(model, args.new_tokens, model_path, vllm))
    gen = torch.Generator().manual_seed(1)
    rows = []
    kv_dtypes = args.kv_cache_dtypes if args.rollout_backend == "native" else ["auto"]
    for batch in args.batches:
        for kv_dtype in kv_dtypes:
            try:
                row = time_batch(args, backend, base, gb, precision, batch, gen, kv_dtype)
            except torch.OutOfMemoryError as exc:  # keep the batches that fitted
                row = {"engine": args.rollout_backend, "precision": precision, "batch": batch, "kv_cache": kv_dtype,
                       "error": str(exc).splitlines()[0]}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        if any("error" in row for row in rows[-len(kv_dtypes) :]):
            break  # a larger batch would not fit either
    del backend, model, base
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rollout-backend", choices=ROLLOUT_BACKENDS, default="auto", help="the engine (auto: native on a GPU)"
    )
    parser.add_argument("--size", choices=SIZES, default="7b")
    parser.add_argument("--precisions", default="nvfp4,bf16")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per row (median and min-max shown)")
    parser.add_argument("--profile", action="store_true", help="native: GPU time per decode step by kernel family")
    parser.add_argument(
        "--kv-cache-dtypes", default="auto", help=f"native: KV-cache dtypes to time, of {', '.join(KV_CACHE_DTYPES)}"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vllm: its share of the whole card, which must be free at its start (default: 75%% of the free share)",
    )
    parser.add_argument("--workdir", default="/tmp/qerl-bench")
    parser.add_argument("--out", default="runs/rollout.json")
    args = parser.parse_args(argv)
    import torch

    from qerl.rollout.native import kv_cache

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.rollout needs a CUDA GPU")
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.kv_cache_dtypes = args.kv_cache_dtypes.split(",")
    for name in args.kv_cache_dtypes:
        kv_cache.resolve(name)  # a bad name fails before any model is built
    args.bw = copy_bandwidth()
    rows = [row for precision in args.precisions.split(",") for row in run(args, precision)]

    print(
        f"\n{args.size} shapes, random weights, LoRA r{args.lora_rank}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {args.rollout_backend}, {torch.cuda.get_device_name()}, "
        f"copy bandwidth {args.bw / 1e12:.2f} TB/s"
    )
    print(
        f"{'weights':8s} {'KV':5s} {'batch':>5s} {'tok/s':>8s} {'ms/step':>8s} {'min-max':>11s} {'floor ms':>8s} "
        f"{'KV GiB':>7s} {'waves':>5s} {'peak GiB':>8s}"
    )
    for r in rows:
        kv = r.get("kv_cache", "auto")
        if "error" in r:
            print(f"{r['precision']:8s} {kv:5s} {r['batch']:5d} {r['error']}")
            continue
        floor = f"{r['floor_ms']:8.2f}" if "floor_ms" in r else f"{'':8s}"
        kv_gib = f"{r['kv_gib']:7.2f} {r['waves']:5d}" if "kv_gib" in r else f"{'':13s}"
        low, high = r["ms_per_step_range"]
        print(
            f"{r['precision']:8s} {kv:5s} {r['batch']:5d} {r['tokens_per_s']:8.0f} {r['ms_per_step']:8.2f} "
            f"{low:5.2f}-{high:5.2f} {floor} {kv_gib} {r['peak_gib']:8.1f}"
        )
        if r["compiled_in_timed_runs"]:
            print(f"    compiled inside the timed runs (the figure is not clean): {r['compiled_in_timed_runs']}")
        for family, us in r.get("kernels_us_per_step", {}).items():
            print(f"    {family:42s} {us:8.1f} us/step")
    by = {
        (r["precision"], r["batch"]): r["tokens_per_s"]
        for r in rows
        if "error" not in r and r.get("kv_cache", "auto") == "auto"
    }
    for batch in args.batches:
        if ("nvfp4", batch) in by and ("bf16", batch) in by:
            print(f"batch {batch}: NVFP4 / BF16 = {by['nvfp4', batch] / by['bf16', batch]:.2f}x")
    ok = {(r["precision"], r["batch"], r.get("kv_cache")): r["tokens_per_s"] for r in rows if "error" not in r}
    for (precision, batch, kv), tps in ok.items():
        if kv == "fp8" and (precision, batch, "auto") in ok:
            print(f"{precision} batch {batch}: FP8 KV / model-dtype KV = {tps / ok[precision, batch, 'auto']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"args": {k: v for k, v in vars(args).items()}, "device": torch.cuda.get_device_name(), "rows": rows},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
