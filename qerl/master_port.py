"""A MASTER_PORT that two QeRL processes starting vLLM on one host at the same moment never both take.

The colocated vLLM engine joins a torch.distributed world of its own when the run has none (one process), at
MASTER_ADDR:MASTER_PORT: its TCPStore listens on that port for the engine's life. TRL's `ensure_master_addr_port`
picks the first free one of 29500, 23456, ... and lets it go before vLLM binds it, so two runs started together
both find 29500 free and the second dies with EADDRINUSE (seen in two leases).

`held_until_bound()` closes the gap between choosing and binding: under an exclusive lock on a file every QeRL
process on the host shares, it asks the OS for a free port, and keeps the lock until that port is listening (read
from /proc/net/tcp, which takes nothing from the binder) or the block ends. Another run's choice then sees the port
taken. The lock is held for the seconds to the bind, not for the engine's whole start. Where MASTER_PORT is already
set (a launcher's, or the user's) or the process is in a distributed world already, it does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import threading
from collections.abc import Iterator

import torch

LOCK_FILE = os.path.join(tempfile.gettempdir(), "qerl-master-port.lock")
POLL_S = 0.05
LISTEN = "0A"  # /proc/net/tcp's state code of a listening socket


def listening(port: int) -> bool | None:
    """Whether a TCP socket on this host listens on `port` (None: the host's tables cannot be read: not Linux)."""
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        found_table = True
        for row in rows:
            fields = row.split()  # sl, local_address (hex ip:port), rem_address, st, ...
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == LISTEN:
                return True
    return False if found_table else None


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def held_until_bound(lock_file: str = LOCK_FILE) -> Iterator[int | None]:
    """Sets MASTER_ADDR (localhost unless set) and a free MASTER_PORT that no other QeRL process on the host can
    choose until something listens on it; yields the port (None where the environment's is kept)."""
    os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or "localhost"
    if os.environ.get("MASTER_PORT") or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield None
        return
    with open(lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        port = _free_port(os.environ["MASTER_ADDR"])
        os.environ["MASTER_PORT"] = str(port)
        done = threading.Event()
        released = threading.Lock()

        def release() -> None:
            with released:
                if not lock.closed and not done.is_set():
                    fcntl.flock(lock, fcntl.LOCK_UN)
                done.set()

        def watch() -> None:
            while not done.wait(POLL_S):
                bound = listening(port)
                if bound is None:  # no tables to read: the lock stays to the block's end (a slower start, no clash)
                    return
                if bound:
                    release()

        watcher = threading.Thread(target=watch, name="qerl-master-port", daemon=True)
        watcher.start()
        try:
            yield port
        finally:
            release()
            watcher.join()
