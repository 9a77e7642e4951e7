"""QeRL on several GPUs through accelerate: DDP, FSDP2, ZeRO-2 and ZeRO-3, on 1 and on 2 GPUs, side by side.

    python -m benchmarks.multi_gpu                                         # random-init Qwen2.5-7B NVFP4 (built once)
    python -m benchmarks.multi_gpu --model /models/SmolLM2-135M-Instruct --configs ddp,zero2 --gpus 1,2
    python -m benchmarks.multi_gpu --dry-run                               # CPU, gloo, the tiny model: the wiring
    python -m benchmarks.multi_gpu --size tiny --steps 3 --new-tokens 16   # GPU, the tiny model: does each config run

For each accelerate config (configs/accelerate/<name>.yaml) and process count: one `accelerate launch` of this
module with --worker (the worker is benchmarks/multi_gpu_worker.py), which runs the real trainer
(qerl.train.build_trainer on the recipe of the checkpoint's precision, torch's AdamW) on the GSM8K sample: --steps
optimizer steps, each rank sampling one prompt x --batch completions of up to --new-tokens tokens (the 7B recipe's
DAPO, LoRA r16, trainable norms, AQN, gradient checkpointing). It reports, per run:
  samples/s           completions per step over all GPUs / mean step time; the first step (compilation, graph
                      capture) and the last (profiled) are left out
  step split          rollout, of which `refresh` (the native engine taking the round's LoRA and norms: the gather of
                      FSDP2's shards or ZeRO-3's partitions happens there), log-prob and loss forwards, backward
                      (ZeRO: with DeepSpeed's optimizer step), other (rewards, optimizer, logging)
  comm                GPU time of the NCCL kernels in the last step after its rollout (the forwards' all-gathers,
                      the backward's all-reduce or reduce-scatter; they can overlap compute), from torch.profiler (on
                      CPU: the gloo collectives' time); the rollout's own gathers are in `refresh`
  peak GiB            torch's peak allocation, the largest of the ranks (every rank's is in the JSON)
  adapters equal      a hash of every trainable tensor, whole (FSDP2 all-gathers, ZeRO-3 gathers), equal on all ranks
  prompts differ      in every generation round, each rank sampled another prompt
A table on stdout, every run in --out (JSON), each run's log under --workdir; a run that fails is reported with the
last line of its log, and the others go on. --simulate-nodes adds DDP as two machines of one GPU each (two
`accelerate launch`es of configs/accelerate/multinode.yaml meeting on localhost).

On the GPU machine NVLink multicast stays off in every child (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1). --dry-run runs the same launches on the CPU with gloo (DeepSpeed through its CPU
accelerator); accelerate runs FSDP only on GPUs, so the dry run skips fsdp.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.launch import REPO, child_env, free_port, kill_session, last_error
from benchmarks.multi_gpu_worker import worker
from qerl.field_rules import ROLLOUT_BACKENDS

CONFIGS = ("ddp", "fsdp", "zero2", "zero3")
PHASES = ("rollout", "refresh", "log-prob forwards", "backward")


# ----------------------------------------------------------------------------------------------------------
# The driver: one launch per (config, GPUs), then the table


def summarize(config: str, gpus: int, batch: int, ranks: list[dict]) -> dict:
    """One run's row from what its ranks reported."""
    timed = slice(1, -1 if ranks[0]["comm_seconds"] is not None else None)  # first step warms up, last profiled
    seconds = ranks[0]["step_seconds"][timed] or ranks[0]["step_seconds"]
    phases = ranks[0]["phases"][timed] or ranks[0]["phases"]
    mean = sum(seconds) / len(seconds)
    split = {name: sum(p.get(name, 0.0) for p in phases) / len(phases) for name in PHASES}
    split["other"] = mean - sum(v for k, v in split.items() if k != "refresh")  # refresh is part of the rollout
    rounds = list(zip(*(r["rounds"] for r in ranks), strict=True))
    return {
        "config": config,
        "gpus": gpus,
        "device": ranks[0]["device"],
        "backend": ranks[0]["backend"],
        "sharding": ranks[0]["sharding"],
        "samples_per_s": batch * gpus / mean,
        "step_s": mean,
        "split_s": split,
        "comm_s": ranks[0]["comm_seconds"],
        "peak_gib": [r["peak_gib"] for r in ranks],
        "peak_driver_gib": [r["peak_driver_gib"] for r in ranks],
        "adapters_equal": len({r["adapters"] for r in ranks}) == 1,
        # One process: nothing to compare (None).
        "prompts_differ": None if len(ranks) == 1 else bool(rounds) and all(len(set(r)) == len(ranks) for r in rounds),
        "step_seconds": ranks[0]["step_seconds"],
    }


def _worker_cmd(args, config: str, result: Path, run_dir: Path) -> list[str]:
    cmd = [
        "-m", "benchmarks.multi_gpu", "--worker", "--config", config, "--model", args.model, "--steps", str(args.steps),
        "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--rollout-backend", args.rollout_backend,
        "--result", str(result), "--run-dir", str(run_dir),
    ]  # fmt: skip
    return cmd + (["--dry-run"] if args.dry_run else []) + (["--no-profile"] if args.no_profile else [])


def launch(args, config: str, gpus: int, nodes: int = 1, gpu_ids: list[int] | None = None) -> dict:
    """One `accelerate launch` (one per simulated node) of the worker; its summary row or its error. `gpu_ids`: the
    GPUs it runs on (CUDA_VISIBLE_DEVICES), so that launches on other GPUs can run beside it; default: the first."""
    name = f"{config}-{gpus}gpu" + (f"-{nodes}nodes" if nodes > 1 else "")
    if gpu_ids is not None and len(gpu_ids) != gpus:
        raise ValueError(f"{name}: {len(gpu_ids)} GPU ids for {gpus} processes")
    gpu_ids = gpu_ids or list(range(gpus))
    workdir = Path(args.workdir)
    result, log = workdir / f"{name}.json", workdir / f"{name}.log"
    result.unlink(missing_ok=True)
    accelerate_config = "multinode" if nodes > 1 else config
    port = free_port()
    procs, logs = [], []
    for node in range(nodes):
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(REPO / "configs" / "accelerate" / f"{accelerate_config}.yaml"), "--num_processes", str(gpus),
            "--main_process_port", str(port),
        ]  # fmt: skip
        env = child_env(threads=1 if args.dry_run else None)
        per_node = gpus // nodes
        if not args.dry_run:  # a simulated machine sees only its own GPUs
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids[node * per_node : (node + 1) * per_node])
        if nodes > 1:  # machines of gpus // nodes GPUs each, meeting at this one
            cmd += ["--num_machines", str(nodes), "--machine_rank", str(node), "--main_process_ip", "127.0.0.1"]
        if args.dry_run:
            cmd += ["--mixed_precision", "no"]
        cmd += _worker_cmd(args, config, result, workdir / f"run-{name}")
        node_log = log if node == 0 else workdir / f"{name}.node{node}.log"
        logs.append(open(node_log, "w"))
        # A session of its own: on a timeout the launcher's workers go with it (they hold GPUs the next launch needs).
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=REPO, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)
        )
    start = time.perf_counter()
    try:
        codes = [p.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - start))) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_session(p)
        codes = [p.wait() for p in procs]
    finally:
        for f in logs:
            f.close()
    elapsed = time.perf_counter() - start
    if any(codes) or not result.is_file():
        return {"config": name, "gpus": gpus, "error": last_error(log).strip(), "log": str(log), "wall_s": elapsed}
    ranks = json.loads(result.read_text())
    if not ranks[0]["step_seconds"]:  # TRL found no full batch (too few prompts for the ranks): nothing measured
        return {
            "config": name,
            "gpus": gpus,
            "error": "trained no step (see the log)",
            "log": str(log),
            "wall_s": elapsed,
        }
    row = summarize(config if nodes == 1 else name, gpus, args.batch, ranks)
    return {**row, "log": str(log), "wall_s": elapsed, "gpu_ids": gpu_ids}


def random_nvfp4_checkpoint(size: str, workdir: Path) -> str:
    """The random-init Qwen2.5 `size` model as an NVFP4 checkpoint under `workdir`, made once: built and quantized one
    decoder layer at a time on the GPU (benchmarks.random_models.build), so a 32B model never exists in BF16 (its ~65 GB
    would not fit beside anything else). Same seed and init order as benchmarks.step.checkpoint, same folder."""
    import torch

    from benchmarks.random_models import build, padded_tokenizer
    from qerl.nvfp4.checkpoint import save_nvfp4_checkpoint

    folder = workdir / f"qwen2.5-{size}-random-nvfp4"
    if (folder / "config.json").is_file():
        return str(folder)
    model = build(size, "nvfp4")
    model.config.eos_token_id = model.generation_config.eos_token_id = 2  # the tiny tokenizer's <|end|>
    save_nvfp4_checkpoint(model, folder, tokenizer=padded_tokenizer(model.config.vocab_size))
    del model
    torch.cuda.empty_cache()
    return str(folder)


def build_model(args, gpu: int | None = None) -> str:
    """The tests' tiny NVFP4 model (--dry-run, --size tiny) or the random-init Qwen2.5 --size NVFP4 model, written
    once under --workdir by a child process on GPU `gpu` (default: the first; the driver keeps no GPU memory)."""
    workdir = Path(args.workdir)
    if args.dry_run or args.size == "tiny":
        tiny = str(workdir / "tiny")
        code = f"from qerl.tiny import save_tiny_checkpoints; print(save_tiny_checkpoints({tiny!r})[1])"
    else:
        code = (
            f"from benchmarks.multi_gpu import random_nvfp4_checkpoint; from pathlib import Path; "
            f"print(random_nvfp4_checkpoint({args.size!r}, Path({str(workdir)!r})))"
        )
    env = child_env(threads=1 if args.dry_run else None)
    if gpu is not None and not args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def table(rows: list[dict]) -> str:
    one_gpu = {r["config"]: r["samples_per_s"] for r in rows if "samples_per_s" in r and r["gpus"] == 1}
    head = (
        f"{'config':16s} {'GPUs':>4s} {'backend':12s} {'samples/s':>9s} {'x1 GPU':>6s} {'step s':>7s} "
        f"{'rollout':>7s} {'refresh':>7s} {'fwd':>6s} {'bwd':>6s} {'other':>6s} {'comm':>6s} {'peak GiB':>8s} "
        f"{'adapters':>8s} {'prompts':>7s}"
    )
    lines = [head]
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(
                f"{r['config']:16s} {r['gpus']:4d} "
                + (f"skipped: {r['skipped']}" if "skipped" in r else f"failed: {r['error']}")
            )
            continue
        s = r["split_s"]
        base = one_gpu.get(r["config"].split("-")[0])
        scale = f"{r['samples_per_s'] / base:6.2f}" if base else f"{'':6s}"
        peak = max((p for p in r["peak_gib"] if p is not None), default=None)
        comm = "" if r["comm_s"] is None else f"{r['comm_s']:6.2f}"
        lines.append(
            f"{r['config']:16s} {r['gpus']:4d} {r['backend']:12s} {r['samples_per_s']:9.2f} {scale} {r['step_s']:7.2f} "
            f"{s['rollout']:7.2f} {s['refresh']:7.2f} {s['log-prob forwards']:6.2f} {s['backward']:6.2f} "
            f"{s['other']:6.2f} {comm:>6s} {'' if peak is None else f'{peak:8.1f}':>8s} "
            f"{'equal' if r['adapters_equal'] else 'DIFFER':>8s} "
            f"{ {None: '-', True: 'differ', False: 'SAME'}[r['prompts_differ']]:>7s}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (NVFP4 or BF16); default: random-init --size")
    parser.add_argument(
        "--size",
        default="7b",
        help="Qwen2.5 shapes of the random-init NVFP4 model (3b, 7b, 14b, 32b), or tiny (the tests' "
        "model: a quick check that every config runs)",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help="accelerate configs (configs/accelerate/*.yaml)")
    parser.add_argument("--gpus", default="1,2", help="process counts to run each config with")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (first and last not timed)")
    parser.add_argument("--batch", type=int, default=8, help="completions per GPU per step (one prompt's group)")
    parser.add_argument("--new-tokens", type=int, default=512, help="max completion length")
    parser.add_argument(
        "--rollout-backend",
        choices=ROLLOUT_BACKENDS,
        default=None,
        help="rollout engine (default: auto, native on a GPU; --dry-run: native, eager on the CPU)",
    )
    parser.add_argument("--simulate-nodes", action="store_true", help="also DDP as 2 machines of 1 GPU each")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled last step (no comm column)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one launch may take")
    parser.add_argument(
        "--gpu-ids",
        default=None,
        help="GPUs to run on (comma-separated CUDA_VISIBLE_DEVICES numbers; default 0..N-1): a "
        "launch of N processes takes the first N",
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny model, short steps: the wiring only")
    parser.add_argument("--workdir", default="/tmp/qerl-multi-gpu")
    parser.add_argument("--out", default="runs/multi_gpu.json")
    # The worker's own flags (set by the driver)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if args.dry_run:
        args.batch, args.new_tokens, args.steps = min(args.batch, 4), min(args.new_tokens, 8), min(args.steps, 3)
    args.rollout_backend = args.rollout_backend or ("native" if args.dry_run else "auto")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    gpu_ids = [int(g) for g in args.gpu_ids.split(",")] if args.gpu_ids else None
    args.model = args.model or build_model(args, gpu_ids[0] if gpu_ids else None)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if not (REPO / "configs" / "accelerate" / f"{c}.yaml").is_file()]
    if unknown:
        raise SystemExit(f"unknown accelerate config(s): {', '.join(unknown)} (configs/accelerate/)")
    plan = [(c, int(g)) for c in configs for g in args.gpus.split(",") if g]
    rows = []
    for config, gpus in plan:
        if args.dry_run and config == "fsdp":
            rows.append({"config": config, "gpus": gpus, "skipped": "accelerate runs FSDP on GPUs only"})
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {config} on {gpus} GPU(s) ...", flush=True)
        rows.append(launch(args, config, gpus, gpu_ids=gpu_ids[:gpus] if gpu_ids else None))
        print(f"    {rows[-1].get('error') or 'done'} ({rows[-1].get('wall_s', 0):.0f} s)", flush=True)
    if args.simulate_nodes:
        print(f"[{time.strftime('%H:%M:%S')}] ddp as 2 machines x 1 GPU ...", flush=True)
        rows.append(launch(args, "ddp", 2, nodes=2, gpu_ids=gpu_ids[:2] if gpu_ids else None))
    print(f"\nmodel {args.model}, {args.batch} completions/GPU/step of <= {args.new_tokens} tokens, {args.steps} steps")
    print(table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
