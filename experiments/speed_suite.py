"""Issue 41's measurements on one machine of one to four GPUs, in one command that a lease can start early and feed:

    python -m experiments.speed_suite run --out runs/speed --site /tmp/gpu-site --gguf /tmp/carry/q15
    python -m experiments.speed_suite summarize --out runs/speed [--bundle DIR]

Jobs, started in list order on the first free GPU (a job whose result file exists is skipped, so a second start
redoes only what was lost); a job whose inputs are still arriving waits for them on its GPU:
  kernels      benchmarks.probes.nvfp4_speed on the 0.5B and 1.5B layers (each GEMM at 1-64 rows against its bytes
               and cuBLAS), then probes.gemm small (the same GEMMs with the engine's LoRA, every CUDA config of a grid)
  gptq         benchmarks.gptq_speed: GPTQ into NVFP4 of one decoder layer at the 1.5B's and 7B's shapes
  rollout      benchmarks.rollout, native engine, NVFP4 and BF16 at 0.5B, 1.5B, 3B, 7B, batch 8 and 64, 512 new
               tokens (the 1.5B with --profile: GPU time per kernel family)
  step-7b      benchmarks.step --profile on the random 7B (the default recipe, 2048 tokens): NVFP4 with and without
               the dense training weights, BF16                                                          (needs --site)
  real-prep    the GGUF converted to BF16 and quantized to NVFP4, beside another job          (needs --site, --gguf)
  real-*       benchmarks.step --profile on the real Qwen2.5-Coder-1.5B-Instruct, its recipe as written, --steps
               steps: NVFP4 without / with the dense training weights, BF16, both with the defaults before e497ac2
               (-before: no cache or activations kept), both with every option below at once (-combined), both with
               live-row compaction (--rollout-compact-rows), both with activations kept in micro-batches of 32
               (-kept-mb32), both with TRL's random micro-batches, both compiled (--compile-layers)
  trl-baseline benchmarks.trl_baseline on the BF16 checkpoint, the same recipe and steps
  server-*     benchmarks.step on one GPU with --rollout-backend server, rollout servers (python -m
               qerl.rollout_server) beside it (-shared) or on 1 or 3 more GPUs, the batch grown with the GPUs;
               -ahead: --rollout-max-staleness 1; -native: the servers on the native engine, else vLLM
  step7b-colocated, server7b-*   the same on the random 7B (default recipe, 2,048 tokens; its checkpoint written
               once by the first job that needs it): colocated on one GPU, and 1 + 1 and 1 + 3 native servers ahead
  gpu-tests    the GPU tests of the dense training weights, the kernels and the native engine       (needs --site)
  vllm-rollout benchmarks.rollout --rollout-backend vllm at 1.5B (vLLM's share from the free memory)  (needs --site)
Results: OUT/results/<job>.json (each benchmark's own JSON); logs: OUT/logs/. `summarize` writes OUT/summary.md
(medians, longest completions, the phase splits, the GEMM tables); --bundle adds results.json and the logs' tails.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.launch import (
    RECIPES,
    child_env,
    gpu_count,
    kill_session,
    last_error,
    run_logged,
    start_rollout_server,
)
from benchmarks.step import checkpoint_folder
from experiments.multi_gpu_runner import Job, run_phase, say
from experiments.speed_summary import summarize

REAL_MODEL = "qwen2.5-coder-1.5b-instruct"
REAL_RECIPE = RECIPES[REAL_MODEL]
SIZES = ("1.5b", "7b", "3b", "0.5b")  # the recipe's size first: a job's later commands run after a failure too
MICRO_BATCH_32 = ["--per-device-train-batch-size", "32", "--gradient-accumulation-steps", "2"]
# The defaults until commit e497ac2, before the cache and graphs kept between rounds and the activations kept (each
# by memory) became the defaults: the same lease's before and after
BEFORE = ["--rollout-keep-between-rounds", "false", "--keep-activations", "false"]
KEPT = ["--rollout-keep-between-rounds", "true", "--keep-activations", "true"]  # whatever the memory rules say
COMPACT = ["--rollout-compact-rows", "true"]
COMPILED = ["--compile-layers", "true"]
# Every speed option at once: the fastest step the code can take today, the figure issue 50's goal reads
COMBINED = [*COMPACT, *KEPT, *MICRO_BATCH_32, *COMPILED]
DENSE = ["--dense-training-weights", "true"]
# name: (NVFP4 or BF16 checkpoint, qerl.train flags) of the real-model step runs, in the order one GPU runs them: the
# defaults' pair, then the newest questions first (a lease that ends early loses the oldest)
REAL_RUNS = {
    "real-nvfp4": ("nvfp4", ["--dense-training-weights", "false"]),
    "real-nvfp4-dense": ("nvfp4", DENSE),
    "real-bf16": ("bf16", []),
    "real-nvfp4-dense-before": ("nvfp4", [*DENSE, *BEFORE]),
    "real-bf16-before": ("bf16", BEFORE),
    "real-nvfp4-dense-combined": ("nvfp4", [*DENSE, *COMBINED]),
    "real-bf16-combined": ("bf16", COMBINED),
    "real-nvfp4-dense-compact": ("nvfp4", [*DENSE, *COMPACT]),
    "real-bf16-compact": ("bf16", COMPACT),
    # micro-batches of 32 with the activations kept: half the passes' launches
    "real-nvfp4-dense-kept-mb32": ("nvfp4", [*DENSE, *KEPT, *MICRO_BATCH_32]),
    "real-bf16-kept-mb32": ("bf16", [*KEPT, *MICRO_BATCH_32]),
    # TRL's random split into micro-batches, the training passes' layout before qerl/micro_batches.py
    "real-nvfp4-dense-random-split": ("nvfp4", [*DENSE, "--group-micro-batches-by-length", "false"]),
    "real-bf16-random-split": ("bf16", ["--group-micro-batches-by-length", "false"]),
    "real-nvfp4-dense-compiled": ("nvfp4", [*DENSE, *COMPILED]),
    "real-bf16-compiled": ("bf16", COMPILED),
}


# Rollouts on their own GPUs (issue 51; docs/multi_gpu.md, "The first GPU lease of rollout servers"): the real
# NVFP4 1.5B trained on one GPU, sampled by rollout servers on the others, the recipe's batch grown with the GPUs
# (weak scaling: each GPU the colocated run's 8 prompts x 8 samples). name: (servers, engine, qerl.train flags)
AHEAD = ["--rollout-max-staleness", "1"]
SERVER_RUNS = {
    # one server beside the trainer on its own GPU (0 more GPUs), the colocated run's batch: the whole path on one
    # card, and what sampling ahead gains when rollout and training share it. In each split the newest question
    # first (a lease that ends early loses the oldest).
    "server-shared-native-ahead": (0, "native", AHEAD),
    "server-shared-ahead": (0, "vllm", AHEAD),
    "server-shared": (0, "vllm", []),
    "server-1p1-native-ahead": (1, "native", ["--gradient-accumulation-steps", "8", *AHEAD]),
    "server-1p1-ahead": (1, "vllm", ["--gradient-accumulation-steps", "8", *AHEAD]),
    "server-1p1": (1, "vllm", ["--gradient-accumulation-steps", "8"]),
    "server-1p3-native-ahead": (3, "native", ["--gradient-accumulation-steps", "16", *AHEAD]),
    "server-1p3-ahead": (3, "vllm", ["--gradient-accumulation-steps", "16", *AHEAD]),
}
# The random 7B on the default recipe (one prompt x 2 samples, 2,048 tokens: rollout ~85% of a colocated step), as
# issue 51's goal names it: colocated on one GPU against 1 + 1 and 1 + 3 native servers one round ahead, the batch
# grown with the GPUs, all on one checkpoint written once (benchmarks.step --write-checkpoint).
RANDOM_7B = ["--size", "7b", "--precision", "nvfp4"]
SERVER_7B_RUNS = {
    "server7b-1p1-native-ahead": (1, "native", ["--gradient-accumulation-steps", "2", *AHEAD]),
    "server7b-1p3-native-ahead": (3, "native", ["--gradient-accumulation-steps", "4", *AHEAD]),
}


@dataclass(frozen=True)
class ServedBase:
    """What a server job's trainer and servers load: the checkpoint's folder, benchmarks.step's flags that name it,
    and `ready(gpu_ids)`, which returns once the folder holds it."""

    folder: str
    flags: list[str]
    ready: Callable[[list[int]], None]


def wait_for(path: Path, what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if time.time() > deadline:
            raise RuntimeError(f"{what} did not arrive in {timeout:.0f} s ({path})")
        time.sleep(5)


def run_commands(args, name: str, commands: list[list[str]], gpu_ids: list[int], site: bool) -> list[str]:
    """Each command (python -m ... arguments) on the job's GPUs, one log each, all of them whatever fails; returns
    what failed, one line each."""
    visible = ",".join(str(args.gpu_ids[i]) if args.gpu_ids else str(i) for i in gpu_ids)
    env = site_env(args, CUDA_VISIBLE_DEVICES=visible) if site else child_env(CUDA_VISIBLE_DEVICES=visible)
    failed = []
    for i, command in enumerate(commands):
        log = Path(args.out) / "logs" / (f"{name}.log" if len(commands) == 1 else f"{name}-{i}.log")
        code = run_logged([sys.executable, *command], log, env=env, timeout=args.timeout)
        if code != 0:
            failed.append(f"exit code {code} ({log}): {last_error(log)}")
    return failed


def site_env(args, **extra: str) -> dict[str, str]:
    """A child's environment with the gpu-site packages (vLLM, trl) after the checkout, once they have arrived."""
    wait_for(Path(args.site) / ".complete", "the gpu-site packages", args.timeout)
    env = child_env(**extra)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{args.site}"
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return env


@contextlib.contextmanager
def rollout_servers(args, name: str, gpu_ids: list[int], model: str, engine: str, shared: bool = False):
    """python -m qerl.rollout_server with `engine` on each of `gpu_ids` (a port and a seed of its own, logs beside the
    job's); yields their addresses, and stops them after. The trainer's handshake waits for them to load; a server
    `shared` with the trainer's GPU takes a third of it (vLLM) or 20 GiB of KV cache (native) and is waited for here
    (vLLM's memory profile must not see the trainer's allocations)."""
    if engine == "native":
        memory = ["--engine", "native", *(["--kv-cache-gib", "20"] if shared else [])]
    else:
        memory = ["--engine", "vllm", "--gpu-memory-utilization", "0.3" if shared else "0.85"]
    servers, urls = [], []
    try:
        for i, gpu in enumerate(gpu_ids):
            env = site_env(args, CUDA_VISIBLE_DEVICES=str(args.gpu_ids[gpu] if args.gpu_ids else gpu))
            log = Path(args.out) / "logs" / f"{name}-server{i}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            server, url = start_rollout_server(model, i + 1, memory, log, env)
            servers.append(server)
            urls.append(url)
        if shared:
            from qerl.rollout.remote import ServerPool  # torch: only where a job runs

            ServerPool(urls, model, lora_rank=0).handshake(timeout=args.timeout)  # waits for /health, checks the base
        yield urls
    finally:
        for server in servers:
            kill_session(server)


def real_base(args) -> ServedBase:
    folder = checkpoints(args)["nvfp4"]
    return ServedBase(folder, ["--model", folder, "--config", str(REAL_RECIPE)], lambda gpu_ids: real_prepared(args))


def random_7b_base(args) -> ServedBase:
    workdir = Path(args.out) / "random"
    flags = [*RANDOM_7B, "--workdir", str(workdir)]

    def ready(gpu_ids):
        workdir.mkdir(parents=True, exist_ok=True)
        with open(workdir / ".lock", "w") as lock:  # jobs on other GPUs at once: one writes, the others then find it
            fcntl.flock(lock, fcntl.LOCK_EX)
            write = ["-m", "benchmarks.step", *flags, "--write-checkpoint"]
            failed = run_commands(args, "random-7b", [write], gpu_ids[:1], site=True)
        if failed:
            raise RuntimeError("; ".join(failed))

    return ServedBase(str(checkpoint_folder("7b", "nvfp4", workdir)), flags, ready)


def server_job(args, name: str, servers: int, engine: str, flags: list[str], steps: list[str], base: ServedBase) -> Job:
    """benchmarks.step on the first of the job's GPUs, its rounds sampled by rollout servers on the others (no others:
    one server beside it)."""
    out = Path(args.out) / "json" / f"{name}.json"

    def work(gpu_ids):
        base.ready(gpu_ids)
        with rollout_servers(args, name, gpu_ids[1:] or gpu_ids[:1], base.folder, engine, shared=servers == 0) as urls:
            command = ["-m", "benchmarks.step", "--out", str(out), *base.flags, "--rollout-backend", "server",
                       "--profile", *steps, "--", "--rollout-servers", *urls, *flags]  # fmt: skip
            failed = run_commands(args, name, [command], gpu_ids[:1], site=True)
        if failed and not out.is_file():
            raise RuntimeError("; ".join(failed))
        return {name: json.loads(out.read_text()), **({"failed": failed} if failed else {})}

    return Job(name, 1 + servers, work, guess=0)


def bench_job(args, name: str, commands: list[tuple[str | None, list[str]]], site: bool = False, after=None) -> Job:
    """A job of `python -m module ...` commands, each given with the key of the JSON file it writes (passed as --out
    right after the module, before any `--`), or None for one that only logs; the result holds the JSON files."""
    out = Path(args.out) / "json"

    def argv(key, cmd):
        return cmd if key is None else [*cmd[:2], "--out", str(out / f"{key}.json"), *cmd[2:]]

    def work(gpu_ids):
        if after is not None:
            after(gpu_ids)
        failed = run_commands(args, name, [argv(key, cmd) for key, cmd in commands], gpu_ids, site)
        found = {
            key: json.loads((out / f"{key}.json").read_text())
            for key, _ in commands
            if key is not None and (out / f"{key}.json").is_file()
        }
        if failed and not found:
            raise RuntimeError("; ".join(failed))
        return {**found, **({"failed": failed} if failed else {})}

    return Job(name, 1, work, guess=0)


def checkpoints(args) -> dict[str, str]:
    ckpt = Path(args.out) / "ckpt"
    return {"bf16": str(ckpt / REAL_MODEL), "nvfp4": str(ckpt / f"{REAL_MODEL}-nvfp4")}


def real_prep_job(args, share: int) -> Job:
    def work(gpu_ids):
        wait_for(Path(args.gguf), "the GGUF", args.timeout)
        folders = checkpoints(args)
        fetch = ["-m", "qerl.models", "fetch", REAL_MODEL, "--output", folders["bf16"], "--gguf", args.gguf]
        quantize = ["-m", "qerl.quantize", "--model", folders["bf16"], "--output", folders["nvfp4"], "--device", "cuda"]
        failed = run_commands(args, "real-prep", [fetch, quantize], gpu_ids, site=True)
        if failed:
            raise RuntimeError("; ".join(failed))
        return folders

    return Job("real-prep", 0, work, guess=0, share=share, holds=lambda r: Path(r["nvfp4"], "config.json").is_file())


def real_prepared(args) -> None:
    """Wait for this machine's real-prep job: its result, and the checkpoints it says it wrote (a result kept from an
    earlier start whose folders are gone must not count)."""
    path = Path(args.out) / "results" / "real-prep.json"
    deadline = time.time() + 2 * args.timeout
    while not (path.is_file() and all(Path(f, "config.json").is_file() for f in checkpoints(args).values())):
        if path.is_file() and "error" in json.loads(path.read_text()):
            raise RuntimeError("no real model: real-prep failed")
        if time.time() > deadline:
            raise RuntimeError(f"the real model's checkpoints did not arrive in {2 * args.timeout} s")
        time.sleep(5)


def jobs(args) -> list[Job]:
    steps = ["--steps", str(args.steps), "--warmup-steps", "1", "--rollout-batches", ""]
    rollout = [
        (f"rollout-{size}", ["-m", "benchmarks.rollout", "--rollout-backend", "native", "--size", size, "--batches",
                             "8,64", "--new-tokens", "512", *(["--profile"] if size == "1.5b" else [])])
        for size in SIZES
    ]  # fmt: skip
    step_7b = [
        (key, ["-m", "benchmarks.step", "--size", "7b", "--precision", precision, "--rollout-backend", "native",
               "--in-memory", "--profile", "--steps", "5", "--rollout-batches", "", "--", *flags])
        for key, precision, flags in (
            ("step-7b-nvfp4", "nvfp4", ["--dense-training-weights", "false"]),
            ("step-7b-nvfp4-dense", "nvfp4", ["--dense-training-weights", "true"]),
            ("step-7b-bf16", "bf16", []),
        )
    ]  # fmt: skip
    found = [
        bench_job(args, "kernels", [("kernels-small", ["-m", "benchmarks.probes.nvfp4_speed", "--models", "0.5B,1.5B",
                                                       "--no-large"]),
                                    (None, ["-m", "benchmarks.probes.gemm", "small"])]),
        bench_job(args, "gptq", [("gptq", ["-m", "benchmarks.gptq_speed", "--sizes", "1.5b,7b"])]),
        bench_job(args, "rollout", rollout),
        bench_job(args, "step-7b", step_7b, site=True),
    ]  # fmt: skip
    # These two run while the real model is being prepared.
    tests = ["-m", "pytest", "-q", "-m", "gpu", "tests/qerl/test_dense_weights.py", "tests/qerl/nvfp4/test_ops.py",
             "tests/qerl/nvfp4/test_triton_kernels.py", "tests/qerl/nvfp4/test_cuda_gemm.py",
             "tests/qerl/rollout/native/test_engine_gpu.py", "tests/qerl/nvfp4/test_linear.py",
             "tests/qerl/test_kept_activations.py"]  # fmt: skip
    found.append(bench_job(args, "gpu-tests", [(None, tests)], site=True))
    vllm = ["-m", "benchmarks.rollout", "--rollout-backend", "vllm", "--size", "1.5b", "--batches", "8,64",
            "--new-tokens", "512"]  # fmt: skip
    found.append(bench_job(args, "vllm-rollout", [("vllm-rollout-1.5b", vllm)], site=True))
    if args.gguf:
        folders, real = checkpoints(args), real_base(args)
        found.append(real_prep_job(args, share=args.gpus - 1))
        for name, (precision, flags) in REAL_RUNS.items():
            command = ["-m", "benchmarks.step", "--model", folders[precision], "--config", str(REAL_RECIPE),
                       "--rollout-backend", "native", "--profile", *steps, "--", *flags]  # fmt: skip
            found.append(bench_job(args, name, [(name, command)], site=True, after=real.ready))
            if name == "real-bf16":  # the anchor runs beside the first three
                anchor = ["-m", "benchmarks.trl_baseline", "--model", folders["bf16"], "--config", str(REAL_RECIPE),
                          "--steps", str(args.steps)]  # fmt: skip
                found.append(bench_job(args, "trl-baseline", [("trl-baseline", anchor)], site=True, after=real.ready))
        # those the machine has the GPUs for (a job waits for as many free GPUs as it holds)
        found += [
            server_job(args, name, n, engine, flags, steps, real)
            for name, (n, engine, flags) in SERVER_RUNS.items()
            if 1 + n <= args.gpus
        ]
    random_7b = random_7b_base(args)
    colocated_7b = ["-m", "benchmarks.step", *random_7b.flags, "--rollout-backend", "native", "--profile", *steps]
    found.append(bench_job(args, "step7b-colocated", [("step7b-colocated", colocated_7b)], site=True,
                           after=random_7b.ready))  # fmt: skip
    found += [
        server_job(args, name, n, engine, flags, steps, random_7b)
        for name, (n, engine, flags) in SERVER_7B_RUNS.items()
        if 1 + n <= args.gpus
    ]
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("run", "summarize"))
    parser.add_argument("--out", default="runs/speed")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the machine (default: all it has)")
    parser.add_argument("--site", default="/tmp/gpu-site", help="the unpacked ../shared/gpu-site (trl, vLLM, gguf)")
    parser.add_argument("--gguf", help="Qwen2.5-Coder-1.5B-Instruct's GGUF (may still be arriving): adds the real runs")
    parser.add_argument("--steps", type=int, default=22, help="real-model steps per run (the first is not counted)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one command or one wait may take")
    parser.add_argument("--retry-failed", action="store_true", help="run again the jobs whose result is an error")
    parser.add_argument("--only", default="", help="run only these jobs (comma-separated names)")
    parser.add_argument(
        "--gpu-ids", default="", help="the machine's GPUs the suite may use (default: all); --gpus counts them"
    )
    parser.add_argument("--bundle", help="summarize: also write summary.md, results.json, logs.tar.gz here")
    args = parser.parse_args(argv)
    if args.gguf:
        args.gguf = str(Path(args.gguf).resolve())
    if args.command == "summarize":
        summarize(args)
        return
    args.gpu_ids = [int(g) for g in args.gpu_ids.split(",") if g]
    args.gpus = len(args.gpu_ids) or args.gpus or gpu_count()
    only = [name for name in args.only.split(",") if name]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    say(f"{args.gpus} GPU(s)")
    run_phase(args, "speed", [job for job in jobs(args) if not only or job.name in only], args.gpus)
    summarize(args)


if __name__ == "__main__":
    main()
