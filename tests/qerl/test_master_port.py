"""qerl/master_port.py: colocated vLLM runs started together on one host get MASTER_PORTs of their own."""

import fcntl
import os
import socket
import subprocess
import sys
import time

import pytest

from benchmarks.launch import child_env
from qerl import master_port

pytestmark = pytest.mark.skipif(master_port.listening(1) is None, reason="reads Linux's /proc/net/tcp")


def _lock_is_free(lock_file: str) -> bool:
    with open(lock_file, "a") as other:  # another open file description: flock sees it as another holder
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(other, fcntl.LOCK_UN)
        return True


def _wait_for(condition, seconds=10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_listening_reads_the_hosts_tcp_table():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
        assert master_port.listening(port) is False  # bound, not listening
        s.listen()
        assert master_port.listening(port) is True
    assert master_port.listening(port) is False


def test_the_port_is_held_until_it_is_bound_then_let_go(tmp_path, monkeypatch):
    lock_file = str(tmp_path / "lock")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with master_port.held_until_bound(lock_file) as port:
        assert os.environ["MASTER_PORT"] == str(port) and os.environ["MASTER_ADDR"] == "localhost"
        time.sleep(5 * master_port.POLL_S)
        assert not _lock_is_free(lock_file)  # chosen, not yet bound: no other run may choose
        with socket.socket() as engine:  # what vLLM's TCPStore does with it
            engine.bind(("localhost", port))
            engine.listen()
            assert _wait_for(lambda: _lock_is_free(lock_file))  # bound: the lock goes before the block ends
    assert _lock_is_free(lock_file)


def test_a_port_the_environment_sets_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29517")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with master_port.held_until_bound(str(tmp_path / "lock")) as port:
        assert port is None and os.environ["MASTER_PORT"] == "29517" and os.environ["MASTER_ADDR"] == "localhost"
        assert _lock_is_free(str(tmp_path / "lock"))


# Each child joins a one-process world at the port it was given, as vLLM's external launcher does, and keeps it
# until every child has joined (a file each in the folder): two runs started together, both alive at once.
CHILD = """
import os, sys, time, torch.distributed as dist
from qerl import master_port
folder, count = sys.argv[1], int(sys.argv[2])
with master_port.held_until_bound(os.path.join(folder, "lock")) as port:
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
open(os.path.join(folder, f"joined-{os.getpid()}"), "w").close()
deadline = time.time() + 60
while sum(name.startswith("joined-") for name in os.listdir(folder)) < count and time.time() < deadline:
    time.sleep(0.05)
print("port", port)
dist.destroy_process_group()
"""


def test_runs_started_together_join_worlds_on_different_ports(tmp_path):
    env = child_env()
    env.pop("MASTER_PORT", None)
    env.pop("MASTER_ADDR", None)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), "3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(3)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    assert [child.returncode for child in children] == [0, 0, 0], [err.decode()[-2000:] for _, err in outputs]
    ports = [int(out.decode().split()[-1]) for out, _ in outputs]
    assert len(set(ports)) == 3
