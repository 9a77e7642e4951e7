"""The runs of experiments.arms: the arms (ARMS), the evaluation protocols and formats; the tasks of each run
(`python -m qerl.train`, then `python -m eval.gsm8k` of its adapter, or of a base without one, each evaluation writing
the run's record); and the runner that puts tasks on GPU slots, each after the task it waits for.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import launch
from benchmarks.launch import REPO, run_or_raise
from experiments.arms_results import (
    OTHER_BASE,
    current_commit,
    gpu_name,
    record_path,
    run_record,
    software_versions,
    write_record,
)

# arm -> (base checkpoint, AQN on). bf16_lora_aqn is the ablation the reference's users asked for (NVlabs/QeRL#11):
# AQN's noise without the quantization it is meant to extend. nvfp4_gptq_lora trains on the NVFP4 base GPTQ rounded
# (qerl.quantize --gptq-calibration; issue 49's lever 3c) instead of rounded to nearest.
ARMS = {
    "bf16_lora": ("bf16", False),
    "nvfp4_lora": ("nvfp4", False),
    "nvfp4_lora_aqn": ("nvfp4", True),
    "bf16_lora_aqn": ("bf16", True),
    "nvfp4_gptq_lora": ("nvfp4_gptq", False),
    "nvfp4_lora_ahead": ("nvfp4", False),
}
# Arms whose rounds a native rollout server beside the trainer samples one round ahead (experiments.beside_server):
# NVFP4 + LoRA trained on rounds one optimizer step behind, against the colocated nvfp4_lora (issue 51's accuracy).
SAMPLED_AHEAD = {"nvfp4_lora_ahead"}
# Issue 49's adapters tried on another base: arm -> the base it trained on; and the names tables give those bases.
LORA_ARMS = {arm: base for arm, (base, aqn) in ARMS.items() if not aqn}
BASE_NAMES = {"bf16": "BF16", "nvfp4": "NVFP4", "nvfp4_gptq": "NVFP4 (GPTQ)"}
PAPER_ARMS = ("bf16_lora", "nvfp4_lora", "nvfp4_lora_aqn", "bf16_lora_aqn")  # the arms a run takes by default
ARM_NAMES = {  # as tables and plots name them
    "bf16_lora": "BF16 + LoRA",
    "nvfp4_lora": "NVFP4 + LoRA",
    "nvfp4_lora_aqn": "NVFP4 + LoRA + AQN",
    "bf16_lora_aqn": "BF16 + LoRA + AQN",
    "nvfp4_gptq_lora": "NVFP4 (GPTQ) + LoRA",
    "nvfp4_lora_ahead": "NVFP4 + LoRA, one round ahead",
}


def precision_of(base: str) -> str:
    """The precision of a base checkpoint's weights: bf16 or nvfp4 (however it was rounded)."""
    return base.split("_")[0]


PROTOCOLS = ("greedy", "reference")
EVAL_FORMATS = {"gsm8k": "think_answer", "gsm8k_hash": "gsm8k_hash", "gsm8k_lenient": "gsm8k_hash"}
say = functools.partial(launch.say, "arms")


# ----------------------------------------------------------------------------------------------------------
# Running: tasks on GPU slots


@dataclass
class Task:
    name: str
    command: list[str] | None  # None: nothing left to do (its output exists)
    log: Path
    after: Task | None = None  # runs once that task succeeded; skipped if it failed
    optional: bool = False  # an evaluation: skipped when it would start after the deadline
    expected_seconds: Callable[[], float] | None = None  # a training: not started when it would end after the deadline
    on_done: Callable[[Task], None] | None = None  # called with it once its command succeeded (a run's record)
    state: str = "pending"  # pending | running | done | failed | skipped
    gpu: int | None = None  # the GPU it ran on
    started: float | None = None  # when its command started (time.time())
    seconds: float | None = None  # how long its command ran


def run_tasks(
    tasks: list[Task],
    gpus: list[int],
    per_gpu: int,
    finish_by: float | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Run the tasks, `per_gpu` at a time on each of the `gpus` (CUDA_VISIBLE_DEVICES; none: one slot set on the CPU),
    the first ready task in list order first, so a finished run's evaluations go before a new training; a task waits
    for the one it comes after. `env`: more environment for every task (CUDA MPS's pipe). Raises SystemExit naming the
    failed tasks once all have ended."""
    lock = threading.Condition()

    def next_ready() -> Task | None:
        with lock:
            while True:
                pending = [t for t in tasks if t.state == "pending"]
                if not pending:
                    return None
                for task in pending:
                    if task.after is not None and task.after.state in ("failed", "skipped"):
                        task.state = "skipped"
                    elif task.after is None or task.after.state == "done":
                        task.state = "running"
                        return task
                lock.wait(timeout=5)

    def late(task: Task) -> bool:
        if finish_by is None:
            return False
        if task.expected_seconds is not None:
            return time.time() + task.expected_seconds() > finish_by
        return task.optional and time.time() > finish_by

    def worker(gpu: int | None) -> None:
        task_env = {**os.environ, **(env or {})}
        if gpu is not None:
            task_env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        while (task := next_ready()) is not None:
            state = "done"
            task.gpu = gpu
            start = time.time()
            try:
                if task.command is not None and late(task):
                    say(f"{task.name}: skipped, it would end past the deadline")
                    state = "skipped"
                elif task.command is not None:
                    task.started = start
                    say(f"{task.name}: started" + (f" on GPU {gpu}" if gpu is not None else ""))
                    run_or_raise(task.command, task.log, env=task_env, append=True)
                    task.seconds = time.time() - start
                    say(f"{task.name}: done in {task.seconds:.0f} s")
                if state == "done" and task.on_done is not None:
                    task.on_done(task)  # also where the output is there from an earlier start: its record may not be
            except (RuntimeError, OSError, ValueError, KeyError) as err:
                state = "failed"
                say(f"{task.name}: FAILED: {err}")
            with lock:
                task.state = state
                lock.notify_all()

    slots = [gpu for _ in range(per_gpu) for gpu in gpus] if gpus else [None] * per_gpu
    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in slots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [t for t in tasks if t.state == "failed"]
    if failed:
        raise SystemExit("failed: " + ", ".join(f"{t.name} ({t.log})" for t in failed))


class RunPace:
    """How long a run (its training and evaluations, waits between them included) takes on this machine: a guess until
    one has finished, then the longest finished. A training that would end past the deadline is not started."""

    def __init__(self, guess_seconds: float):
        self.guess = guess_seconds
        self.seen: list[float] = []

    def observe(self, seconds: float) -> None:
        self.seen.append(seconds)

    def estimate(self) -> float:
        return max(self.seen) if self.seen else self.guess


@contextlib.contextmanager
def mps_daemon(folder: Path):
    """CUDA MPS for the runs on a GPU: their kernels share its SMs instead of time-slicing whole processes (several
    small runs per GPU go ~1.6x faster together). Yields the environment a run opts in with; stops the daemon after."""
    pipe, log = folder / "mps-pipe", folder / "mps-log"
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    try:
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env={**os.environ, **env}, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        raise SystemExit(f"--mps: nvidia-cuda-mps-control -d failed ({err})") from None
    say(f"CUDA MPS on (pipe {pipe})")
    try:
        yield env
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env={**os.environ, **env})


def train_task(
    args, name: str, base: str, aqn: bool, lr: float, seed: int, steps: int, save_every: int = 0, ahead: bool = False
) -> Task:
    """`python -m qerl.train` of the run; `ahead`: through experiments.beside_server, its rounds sampled one round
    ahead by a native rollout server beside it (the run's own flags are the same)."""
    folder = args.out / name
    config = launch.recipe_for(args.model, args.recipe)
    beside = ["-m", "experiments.beside_server", "--model", base, "--seed", str(seed), "--"]
    program = beside if ahead else ["-m", "qerl.train"]
    command = [sys.executable, *program, "--config", str(config), "--model-name", base, "--dataset",
               str(args.train_data), "--dataset-format", args.format, "--aqn", str(aqn).lower(), "--learning-rate",
               str(lr), "--seed", str(seed), "--max-steps", str(steps), "--output-dir", str(folder), "--temperature",
               str(args.temperature), "--overwrite-output-dir", "true"]  # fmt: skip
    if save_every:
        command += ["--save-strategy", "steps", "--save-steps", str(save_every)]
    if args.per_gpu > 1:  # runs sharing a GPU each see the others' memory as free: the recipe's checkpointing holds
        command += ["--keep-activations", "false"]
    done = (folder / "adapter_config.json").exists()
    return Task(
        f"{name} train ({steps} steps, lr {lr:g})", None if done else command + args.train_flags, folder / "log.txt"
    )


def eval_task(args, base: str, adapter: Path | None, protocol: str, out: Path, after: Task | None) -> Task:
    command = [sys.executable, "-m", "eval.gsm8k", "--model", base, "--data", str(args.test_data),
               "--format", EVAL_FORMATS[args.format], "--protocol", protocol, "--max-new-tokens",
               str(args.eval_tokens), "--out", str(out), "--kv-cache-gib", str(args.eval_kv_gib)]  # fmt: skip
    if args.eval_limit:
        command += ["--limit", str(args.eval_limit)]
    if adapter:
        command += ["--adapter", str(adapter)]
    return Task(
        f"{out.parent.name} {out.stem}", None if out.exists() else command, out.parent / "log.txt", after, optional=True
    )


# ----------------------------------------------------------------------------------------------------------
# A run's tasks and its record


def recipe_sha256(args) -> str:
    """The SHA-256 of the recipe file the runs train on now (--recipe, else the model's): records carry it, so that
    runs of a recipe since changed are never pooled with runs of the recipe as it is."""
    return hashlib.sha256(launch.recipe_for(args.model, args.recipe).read_bytes()).hexdigest()


def experiment_setting(args, steps: int) -> dict:
    """What every record of this invocation shares: the recipe and how the runs were packed on the machine."""
    recipe = launch.recipe_for(args.model, args.recipe)
    sharing = "mps" if args.mps else "alone" if args.per_gpu == 1 else "shared"
    return {
        "model": Path(args.model).name.removesuffix("-nvfp4"),
        "recipe": str(recipe.relative_to(REPO)) if recipe.is_relative_to(REPO) else str(recipe),
        "recipe_sha256": recipe_sha256(args),
        "format": args.format,
        "temperature": args.temperature,
        "steps": steps,
        "train_flags": args.train_flags,
        "sharing": sharing,
        "runs_per_gpu": args.per_gpu if args.gpu_ids else None,
        "commit": current_commit(),
        "software": software_versions(),
    }


def run_group(args, name, base, trained, run, save_every, steps, pace, other_base: str | None = None) -> list:
    """A run's training, then its evaluations (with `other_base`, last the adapter greedy on that base too), then its
    checkpoints': each evaluation rewrites the run's record."""
    folder = args.out / name
    tasks = [trained, *eval_tasks(args, name, base, folder, folder, trained, run, pace)]
    if other_base is not None:
        task = eval_task(args, other_base, folder, "greedy", folder / f"eval-{OTHER_BASE}.jsonl", tasks[-1])
        task.on_done = tasks[-1].on_done
        tasks.append(task)
    for step in range(save_every, steps, save_every) if save_every else ():
        out = folder / f"eval-greedy-step{step}.jsonl"
        task = eval_task(args, base, folder / f"checkpoint-{step}", "greedy", out, tasks[-1])
        task.on_done = tasks[-1].on_done
        tasks.append(task)
    return tasks


def eval_tasks(args, name, base, adapter, folder, trained, setting, pace) -> list:
    """The evaluations of a run (or a base: no adapter) in protocol order, each after the one before, each writing
    the record with what is evaluated so far (the first protocol, greedy, is the one the report needs most); the
    last tells `pace` how long the run took."""
    tasks = []
    write = functools.partial(_write_record, args, name, folder, setting, trained, pace)
    for protocol in args.protocols:
        after = tasks[-1] if tasks else trained
        task = eval_task(args, base, adapter, protocol, folder / f"eval-{protocol}.jsonl", after)
        task.on_done = write
        tasks.append(task)
    return tasks


def _write_record(args, name: str, folder: Path, setting: dict, trained, pace, evaluated) -> None:
    """The record of a run (or base) with the evaluations done so far; its card is the one it trained on (a base's:
    the one it was evaluated on)."""
    protocols = tuple(p for p in args.protocols if (folder / f"eval-{p}.jsonl").exists())
    if pace is not None and trained.started is not None and len(protocols) == len(args.protocols):
        pace.observe(time.time() - trained.started)
    gpu = (trained or evaluated).gpu
    extra = {"card": gpu_name(gpu) if args.gpu_ids else "cpu", "gpu": gpu}
    if trained is not None and trained.seconds is not None:
        extra["train_seconds"] = round(trained.seconds, 1)
    write_record(record_path(args.results, name), run_record(folder, {**setting, **extra}, protocols))
