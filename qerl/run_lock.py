"""One training run per output folder: a lock file holding the owner's process id.

The lock is an advisory `flock` on `<output_dir>/.qerl-train.lock`, so the operating system releases it when its
process ends, however it ends: a lock file left by a killed run is stale by definition, and the next run takes it
over (and says so). The process id in the file is what a refused run names.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from pathlib import Path

from qerl.errors import UsageError

LOCK_FILE = ".qerl-train.lock"

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
            logger.warning("%s: took over the lock of process %s, which ended without releasing it",
                           self.path.parent, " on ".join(earlier[:2]))  # fmt: skip
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
