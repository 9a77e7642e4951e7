"""The Makefile: `make setup`'s stamp lives in the environment it vouches for."""

import subprocess
import sys
from pathlib import Path

from benchmarks.launch import REPO


def test_setup_stamp_lives_in_the_environment():
    """A second environment must not inherit a checkout's "installed" stamp."""
    import sysconfig

    result = subprocess.run(
        ["make", "-np", f"PYTHON={sys.executable}", "setup"], cwd=REPO, capture_output=True, text=True
    )
    stamp = next(line.split(":=", 1)[1].strip() for line in result.stdout.splitlines() if line.startswith("STAMP :="))
    assert Path(stamp).parent == Path(sysconfig.get_path("purelib"))
    assert not stamp.startswith(str(REPO))
    setup = (REPO / "setup_env.sh").read_text()
    assert "https://download.pytorch.org/whl/cpu" in setup and "CUDA" in setup
