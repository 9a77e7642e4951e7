"""What the tests of the command-line tools share: the quantizer script loaded as a module, the environment of a
child process that runs this checkout, and a snapshot of a folder (to show that a refused run changed nothing)."""

import importlib.util
import os
from pathlib import Path

from qerl import cli

REPO = Path(__file__).resolve().parents[1]
QUANTIZER = REPO / "llm-compressor" / "quantize_nvfp4.py"


def _load_quantizer():
    spec = importlib.util.spec_from_file_location("quantize_nvfp4", QUANTIZER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quantize_nvfp4 = _load_quantizer()


def child_env(**extra) -> dict[str, str]:
    """This environment for a child that imports this checkout's qerl, without --debug's variable."""
    env = {k: v for k, v in os.environ.items() if k != cli.DEBUG_ENV}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under root (hidden ones too) with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }
