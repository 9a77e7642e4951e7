"""What a model name points to, read without loading anything: a local path or a hub id, and whether a
safetensors file is whole. The checkpoint format (nvfp4/checkpoint/format.py) and the input checks
(input_checks.py) both build on these; nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from qerl.errors import UsageError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_path(name: str) -> bool:
    """Whether a model name can only mean a local path: not shaped like a hub id (org/name), or its first part is
    a folder here (ckpt/qwen-7b with ./ckpt present)."""
    if not _HUB_ID.match(name):
        return True
    return "/" in name and os.path.isdir(name.split("/", 1)[0])


def check_safetensors(path: str | os.PathLike) -> dict:
    """A safetensors file whose header parses and whose size matches what the header describes (a truncated
    download or copy fails here, by name, rather than deep inside a load); returns the header (tensor name ->
    dtype, shape, offsets)."""
    path = Path(path)
    size = path.stat().st_size
    bad = f"{path}: truncated or corrupt safetensors file"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UsageError(f"{bad} ({size} bytes, shorter than a header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise UsageError(f"{bad} (header of {header_len} bytes in a file of {size})")
        try:
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            end = max((t["data_offsets"][1] for t in header.values()), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise UsageError(f"{bad} (unreadable header)") from None
    if 8 + header_len + end != size:
        raise UsageError(f"{bad} (its header describes {8 + header_len + end} bytes, the file has {size})")
    return header
