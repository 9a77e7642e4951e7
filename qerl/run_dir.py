"""A training run's output folder: which run may use it, and what it may already hold.

One run per folder: RunLock is an advisory `flock` on `<output_dir>/.qerl-train.lock`, so the operating system
releases it when its process ends, however it ends: a lock file left by a killed run is stale by definition, and the
next run takes it over (and says so). The process id in the file is what a refused run names.

Checkpoints are `checkpoint-N` folders, complete once transformers has written their trainer_state.json (last):
`--resume-from-checkpoint true` continues from the newest complete one (resolve_resume). A fresh start never lands
on an earlier run's checkpoints or adapter unless --overwrite-output-dir says to delete them (prepare_output_dir).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from qerl.errors import UsageError
from qerl.input_checks import check_adapter

if TYPE_CHECKING:
    from qerl.config import QeRLConfig

LOCK_FILE = ".qerl-train.lock"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")

logger = logging.getLogger(__name__)


class RunLock:
    """Held from `acquire` until `release` (or the process's end). `check` refuses as `acquire` would, writing
    nothing: a run checks first, checks its other settings, then acquires."""

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None
        self._made_folder = False

    def acquire(self) -> None:
        """Take the lock, or raise a UsageError naming the run that holds it (and change nothing on disk)."""
        self._made_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self.check()
                continue  # released in between: try again
            # The file may have been removed by its releasing owner between our open and our lock: lock the new one.
            if os.path.exists(self.path) and os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                break
            os.close(fd)
        earlier = os.read(fd, 200).decode(errors="replace").split()
        if earlier and earlier[0] != str(os.getpid()):
            logger.warning(
                "%s: took over the lock of process %s, which ended without releasing it",
                self.path.parent,
                " on ".join(earlier[:2]),
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def check(self) -> None:
        """Raise a UsageError naming the run that holds the lock, if one does (a shared lock cannot be had then)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = " on ".join(os.read(fd, 200).decode(errors="replace").split()[:2]) or "unknown"
            raise UsageError(
                f"--output-dir {self.path.parent} is in use by another run (process {owner}; lock file {self.path}): "
                "wait for it to end, or choose another --output-dir"
            ) from None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking, so that no one locks a file about to vanish
        os.close(self._fd)
        self._fd = None
        if self._made_folder:  # a run that stopped before writing anything leaves no folder either
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


def _is_complete(checkpoint: Path) -> bool:
    """transformers writes trainer_state.json last: a checkpoint without it was cut short."""
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return True


def _checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N folders, newest first."""
    found = [p for p in output_dir.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name)] if output_dir.is_dir() else []
    return sorted(found, key=lambda p: int(_CHECKPOINT.match(p.name).group(1)), reverse=True)


def resolve_resume(value: str | None, output_dir: str) -> str | None:
    """'true' -> the newest complete checkpoint in output_dir (None if there is none yet); a path -> that one."""
    if value is None or str(value).lower() in ("", "false", "no", "0", "none"):
        return None
    if str(value).lower() in ("true", "yes", "1", "auto", "last"):
        for checkpoint in _checkpoints(Path(output_dir)):
            if _is_complete(checkpoint):
                return str(checkpoint)
            logger.warning(
                "skipping %s: incomplete (no trainer_state.json; the run stopped while saving it)", checkpoint
            )
        logger.warning("no complete checkpoint in %s yet: starting from scratch", output_dir)
        return None
    if not os.path.isdir(value):
        raise UsageError(f"--resume-from-checkpoint {value}: no such checkpoint folder")
    if not _is_complete(Path(value)):
        raise UsageError(f"--resume-from-checkpoint {value}: incomplete (no readable trainer_state.json)")
    return value


def where_to_resume(output_dir: str) -> str:
    newest = next((c.name for c in _checkpoints(Path(output_dir)) if _is_complete(c)), None)
    if newest is None:
        return "no checkpoint saved yet"
    return f"{newest} is the newest complete checkpoint; --resume-from-checkpoint true continues from it"


def prepare_output_dir(config: QeRLConfig, model_name: str, overwrite: bool, lock: RunLock | None) -> str | None:
    """The checkpoint to resume from (None: a fresh start), with the folder's `lock` taken. A fresh start never
    lands on an earlier run's checkpoints or adapter unless --overwrite-output-dir says to delete them."""
    output_dir = Path(config.output_dir)
    if lock is not None:
        lock.check()  # a run in progress there comes first; nothing is written before the last refusal
    resume = resolve_resume(config.resume_from_checkpoint, config.output_dir)
    earlier = []
    if resume is not None:
        if overwrite:
            raise UsageError("--overwrite-output-dir and --resume-from-checkpoint contradict each other: pick one")
        check_adapter(resume, "--resume-from-checkpoint", model_name, "--model-name", config.lora_rank)
        with open(os.path.join(resume, "trainer_state.json")) as f:
            step = json.load(f)["global_step"]
        total = config.max_steps if config.max_steps > 0 else "the epochs asked for"
        logger.info("resuming from %s, step %d of %s", os.path.basename(os.path.normpath(resume)), step, total)
    else:
        earlier = _checkpoints(output_dir) + [output_dir / f for f in _ADAPTER_FILES if (output_dir / f).exists()]
        if earlier and not overwrite:
            raise UsageError(
                f"--output-dir {output_dir} holds an earlier run ({', '.join(p.name for p in earlier[:3])}): pass "
                "--resume-from-checkpoint true to continue it, or --overwrite-output-dir to start over (deleting them)"
            )
    if lock is not None:
        lock.acquire()
    if earlier and config.process_index == 0:
        for path in earlier:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        logger.info(
            "--overwrite-output-dir: deleted %s of the earlier run in %s",
            ", ".join(p.name for p in earlier),
            output_dir,
        )
    return resume
