"""Interrupted runs, as the tests of qerl.train and qerl.quantize make them: real signals to real processes, paused
where it hurts most. The children run the real entry points; a harness (in each test file) only holds them at one point
of their work until the signal is on its way. Here: starting a harness, waiting for it to reach its point, and the one
line an interrupted program says."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.launch import child_env


def start(harness: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", harness, *map(str, args)],
        env=child_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the child never reached {path.name}:\n{process.communicate()[1][-3000:]}")
        time.sleep(0.02)


def assert_interrupted(stderr: str, prog: str, signal_name: str) -> None:
    """One line of the program's own says so (progress bars may close after it), and no traceback."""
    assert "Traceback" not in stderr, stderr
    assert [line for line in stderr.splitlines() if line.startswith(f"{prog}: ")] == [
        f"{prog}: interrupted by {signal_name}"
    ], stderr
