"""Interrupted and concurrent runs lose nothing: real signals to real processes, paused where it hurts most.

The children run the real entry points; a harness only holds them at one point of their work (a training run in
the middle of saving a checkpoint, the quantizer before its shard is written) until the signal is on its way.
"""

import json
import logging
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from clis import snapshot
from fakes import train_argv

from benchmarks.launch import child_env
from qerl import cli, quantize, train
from qerl.run_dir import LOCK_FILE

# Holds the run inside the save of checkpoint-2, after the adapter and optimizer and before trainer_state.json, until
# the file `sent` says that the signal was sent.
TRAIN_HARNESS = textwrap.dedent("""
    import os, sys, time
    from qerl import train
    from qerl.trainer import QeRLTrainer

    saving, sent = sys.argv[1:3]
    save_rng_state = QeRLTrainer._save_rng_state

    def held(self, output_dir):
        if self.state.global_step == 2:
            open(saving, "w").close()
            while not os.path.exists(sent):
                time.sleep(0.01)
        save_rng_state(self, output_dir)

    QeRLTrainer._save_rng_state = held
    sys.exit(train.run(sys.argv[3:]))
""")

# Holds the quantizer before it writes its one shard (its work folder exists by then) for a minute: the signal comes
# in that minute.
QUANTIZE_HARNESS = textwrap.dedent("""
    import runpy, sys, time
    from qerl.nvfp4.checkpoint import write

    flush, marker = write.ShardWriter.flush, sys.argv[1]

    def held(self):
        open(marker, "w").close()
        time.sleep(60)
        flush(self)

    write.ShardWriter.flush = held
    sys.argv = ["qerl.quantize", *sys.argv[2:]]
    runpy.run_module("qerl.quantize", run_name="__main__")
""")


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


def test_training_interrupted_while_saving_keeps_whole_checkpoints_and_resumes(checkpoints, tmp_path, caplog):
    """SIGINT in the middle of saving checkpoint-2: the save completes, then the run stops in one line, leaving
    checkpoint-1 and checkpoint-2 whole and no final adapter; a resume continues from checkpoint-2, taking over the
    lock that a killed run left behind and saying so."""
    _, nvfp4_dir = checkpoints
    out, saving, sent = tmp_path / "run", tmp_path / "saving", tmp_path / "sent"
    child = start(TRAIN_HARNESS, saving, sent, *train_argv(nvfp4_dir, str(out), 4))
    wait_for(saving, child)
    child.send_signal(signal.SIGINT)
    sent.touch()
    _, stderr = child.communicate(timeout=240)
    assert child.returncode == 128 + signal.SIGINT, stderr
    assert_interrupted(stderr, "qerl.train", "SIGINT")
    assert "stopped at step 2: checkpoint-2 is the newest complete checkpoint" in stderr
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-1", "checkpoint-2"]
    for checkpoint in ("checkpoint-1", "checkpoint-2"):
        assert json.loads((out / checkpoint / "trainer_state.json").read_text())["global_step"] == int(checkpoint[-1])
        assert (out / checkpoint / "rng_state.pth").is_file() and (out / checkpoint / "optimizer.pt").is_file()
    assert not (out / "adapter_model.safetensors").exists()  # the run did not end: no final adapter
    assert not (out / LOCK_FILE).exists()  # released on the way out

    (out / LOCK_FILE).write_text("999999999 elsewhere\n")  # a run killed outright leaves its lock file
    with caplog.at_level(logging.INFO):
        resumed = train.main(train_argv(nvfp4_dir, str(out), 3, "--resume-from-checkpoint", "true"))
    messages = [r.getMessage() for r in caplog.records]
    assert any("took over the lock of process 999999999 on elsewhere" in m for m in messages), messages
    assert "resuming from checkpoint-2, step 2 of 3" in messages
    assert resumed.state.global_step == 3 and (out / "adapter_model.safetensors").is_file()
    assert not (out / LOCK_FILE).exists()


def test_quantizer_interrupted_leaves_no_output(checkpoints, tmp_path, caplog):
    """SIGTERM midway: the work folder is removed on the way out, the output never appears, one line says why.
    SIGKILL midway: the work folder stays (nothing runs after SIGKILL) and the next run removes it, saying so."""
    bf16_dir, _ = checkpoints
    children = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        folder = tmp_path / sig.name
        folder.mkdir()
        children[sig] = start(QUANTIZE_HARNESS, folder / "held", "--model", bf16_dir, "--output", folder / "out")
    for sig, child in children.items():  # both held at once: their imports overlap
        wait_for(tmp_path / sig.name / "held", child)
        child.send_signal(sig)
    _, stderr = children[signal.SIGTERM].communicate(timeout=120)
    assert children[signal.SIGTERM].returncode == 128 + signal.SIGTERM
    assert_interrupted(stderr, "qerl.quantize", "SIGTERM")
    assert sorted(p.name for p in (tmp_path / "SIGTERM").iterdir()) == ["held"]

    killed = children[signal.SIGKILL]
    killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL
    partial = tmp_path / "SIGKILL" / f".out.partial-{killed.pid}"
    assert sorted(p.name for p in (tmp_path / "SIGKILL").iterdir()) == [partial.name, "held"]
    before = snapshot(Path(bf16_dir))
    assert (
        cli.run_cli(
            quantize.main, "qerl.quantize", ["--model", bf16_dir, "--output", str(tmp_path / "SIGKILL" / "out")]
        )
        == 0
    )
    assert any(f"removed {partial}" in r.getMessage() for r in caplog.records)
    assert sorted(p.name for p in (tmp_path / "SIGKILL").iterdir()) == ["held", "out"]
    assert snapshot(Path(bf16_dir)) == before
