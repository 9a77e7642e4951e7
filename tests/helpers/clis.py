"""What the tests of the command-line tools share: the quantizer script loaded as a module and a snapshot of a folder
(to show that a refused run changed nothing). A child process's environment is benchmarks.launch.child_env."""

import importlib.util
from pathlib import Path

from benchmarks.launch import REPO

QUANTIZER = REPO / "llm-compressor" / "quantize_nvfp4.py"


def _load_quantizer():
    spec = importlib.util.spec_from_file_location("quantize_nvfp4", QUANTIZER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quantize_nvfp4 = _load_quantizer()


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under root (hidden ones too) with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }
