"""experiments/lease.sh: a command started in a session of its own outlives the call that started it, a second start
does not start it twice, and every call packs the records under results/ and the logs' tails into $OUT."""

import os
import signal
import subprocess
import tarfile
import uuid

from benchmarks.launch import REPO

SCRIPT = REPO / "experiments" / "lease.sh"


def lease(*args, out, wait_s=30):
    env = {**os.environ, "OUT": str(out), "WAIT_S": str(wait_s)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def members(path) -> list[str]:
    with tarfile.open(path) as tar:
        return tar.getnames()


def test_start_wait_and_pack(tmp_path):
    name = f"test-{uuid.uuid4().hex[:8]}"
    work = f"/tmp/qerl-{name}"
    command = "mkdir -p results/sweep; echo '{}' > results/sweep/a.json; echo step > out.log; sleep 30"
    try:
        started = lease("start", name, "--", "bash", "-c", command, out=tmp_path, wait_s=2)
        assert started.returncode == 0 and f"{name}: started" in started.stdout
        assert f"{name}: still running: call wait again" in started.stdout
        again = lease("start", name, "--", "true", out=tmp_path, wait_s=0)
        assert f"{name}: already running" in again.stdout
        assert "results/sweep/a.json" in members(tmp_path / f"{name}-results.tar.gz")
        assert "tails/src_out.log" in members(tmp_path / f"{name}-logs.tar.gz")
        os.killpg(int(open(f"{work}/pid").read()), signal.SIGTERM)
        done = lease("wait", name, out=tmp_path, wait_s=5)
        assert f"{name}: not running" in done.stdout
    finally:
        subprocess.run(["rm", "-rf", work])
    assert lease("begin", name, out=tmp_path).returncode == 2
