"""What the tools share to run things, in one place for benchmarks/, experiments/ and the tests: the checkout's paths
(REPO, the GSM8K rows shipped in tests/data, the real models' recipes), the environment of a child process that runs
this checkout (child_env), a free port, a command run with its output in a log file (run_logged: a timeout kills its
whole process session; run_or_raise says why it failed), the line of a failed run's log that says why (last_error),
the GPUs visible (gpu_count) and a timestamped progress line (say).

The lowest of the tool folders: experiments/ imports benchmarks/, never the reverse, and both import this.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from qerl import cli

REPO = Path(__file__).resolve().parents[1]
GSM8K_SAMPLE = REPO / "tests" / "data" / "gsm8k" / "train_sample.jsonl"  # real GSM8K rows that ship with the checkout
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"  # the whole train/test files, beside the checkout
RECIPES = {  # a fetchable real model -> the recipe its runs use
    "smollm2-135m-instruct": REPO / "configs" / "smollm2_gsm8k_hash.yaml",
    "qwen2.5-coder-1.5b-instruct": REPO / "configs" / "qwen2.5_coder_1.5b_gsm8k_hash.yaml",
}
# Kept off on the GPU machines of this project (their KINDS.md): NVLink multicast.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_print_lock = threading.Lock()


def recipe_for(model: str, override: Path | None = None) -> Path:
    """The recipe of a fetchable model (or its folder, named as fetch names it), unless one is given."""
    if override:
        return override
    name = Path(model).name.removesuffix("-nvfp4")
    if name not in RECIPES:
        raise SystemExit(f"no recipe known for {model}; pass --recipe (known: {', '.join(RECIPES)})")
    return RECIPES[name]


def say(who: str, message: str) -> None:
    """`[who HH:MM:SS] message`, whole lines from several threads."""
    with _print_lock:
        print(f"[{who} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def child_env(threads: int | None = None, **extra: str) -> dict[str, str]:
    """This environment for a child that runs this checkout: the checkout first on PYTHONPATH, NVLink multicast off,
    --debug's variable dropped (its errors are one line, as a user sees them); `threads`: OMP_NUM_THREADS (one per
    process where several share a small CPU)."""
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    env.update(GPU_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return {**env, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rollout_server(
    model: str, seed: int, flags: list[str], log: Path, env: dict[str, str]
) -> tuple[subprocess.Popen, str]:
    """`python -m qerl.rollout_server` on `model` with `flags` on a free port, in a session of its own (kill_session
    stops it), its output to `log`: (the process, its address). The trainer's handshake waits for it to load."""
    port = free_port()
    command = [sys.executable, "-m", "qerl.rollout_server", "--model", model, "--port", str(port), "--seed", str(seed),
               *flags]  # fmt: skip
    with open(log, "w") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True
        )
    return server, f"http://127.0.0.1:{port}"


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group of `proc`, started with start_new_session (it and every child it made)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_logged(
    command: list[str], log: Path, env: dict[str, str] | None = None, timeout: float | None = None, append: bool = False
) -> int:
    """Run `command` from the checkout in a process session of its own, its output (after the command line) to `log`;
    past `timeout` seconds it and its children are killed (-9). Returns the exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a" if append else "w") as f:
        f.write("$ " + " ".join(command) + "\n")
        f.flush()
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            proc.wait()
            f.write(f"\nkilled after {timeout} s\n")
            return -9
        if code != 0:
            f.write(f"exit code {code}\n")
        return code


def run_or_raise(command: list[str], log: Path, **kwargs) -> None:
    """run_logged, and a RuntimeError naming the exit code, the log and its last error line when it fails."""
    code = run_logged(command, log, **kwargs)
    if code != 0:
        raise RuntimeError(f"exit code {code} ({log}): {last_error(log)}")


def last_error(log: Path) -> str:
    """The last line of `log` that names an error (else its last line)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")[-300:]


def gpu_count() -> int:
    """GPUs visible, counted by a child process (the caller keeps CUDA uninitialised: no context on GPU 0)."""
    code = "import torch; print(torch.cuda.device_count())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1])
