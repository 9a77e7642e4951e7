"""The runs of experiments.arms: the arms (ARMS), the evaluation protocols and formats; the command of each run
(`python -m qerl.train`, then `python -m eval.gsm8k` of its adapter, or of a base without one); the runner that puts
runs on GPU slots, each after the run it waits for; and the readers of what the runs wrote (metrics.jsonl, an
evaluation's summary line).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import launch
from benchmarks.launch import run_or_raise
from qerl import plotting

# arm -> (base checkpoint precision, AQN on). bf16_lora_aqn is the ablation the reference's users asked for
# (NVlabs/QeRL#11): AQN's noise without the quantization it is meant to extend.
ARMS = {
    "bf16_lora": ("bf16", False),
    "nvfp4_lora": ("nvfp4", False),
    "nvfp4_lora_aqn": ("nvfp4", True),
    "bf16_lora_aqn": ("bf16", True),
}
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


def train_task(args, name: str, base: str, aqn: bool, lr: float, seed: int, steps: int, save_every: int = 0) -> Task:
    folder = args.out / name
    config = launch.recipe_for(args.model, args.recipe)
    command = [sys.executable, "-m", "qerl.train", "--config", str(config), "--model-name", base, "--dataset",
               str(args.train_data), "--dataset-format", args.format, "--aqn", str(aqn).lower(), "--learning-rate",
               str(lr), "--seed", str(seed), "--max-steps", str(steps), "--output-dir", str(folder), "--temperature",
               str(args.temperature), "--overwrite-output-dir", "true"]  # fmt: skip
    if save_every:
        command += ["--save-strategy", "steps", "--save-steps", str(save_every)]
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
# Reading the runs


def metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return plotting.read_metrics(str(path)) if path.exists() else []


def seconds_per_step(folder: Path) -> float | None:
    """A step's wall time once warm: TRL's step_time (rollout, forwards, backward) over the last half of the steps."""
    times = [r["step_time"] for r in metrics(folder) if "step_time" in r]
    return statistics.fmean(times[len(times) // 2 :]) if times else None


def late_reward(rows: list[dict]) -> float:
    """Mean training reward over the last half of the steps: the sweep's criterion."""
    half = rows[len(rows) // 2 :]
    return statistics.fmean(r["reward"] for r in half) if half else float("nan")


def eval_summary(path: Path) -> dict | None:
    if not path.exists():
        return None
    with open(path) as f:
        return json.loads(f.readline())
