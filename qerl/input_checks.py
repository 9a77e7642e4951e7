"""The checks of flags and input files that the command-line tools share (`python -m qerl.train`, `eval.gsm8k` /
`eval.competition_math`, llm-compressor/quantize_nvfp4.py): a device, a model folder, a LoRA adapter (and whether it
fits its base), a data file and its columns, a dataset name. Each refuses with a UsageError that names the flag and the
file at fault, before anything heavy loads: nothing here imports torch at module level.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from qerl.errors import UsageError, nearest, one_line
from qerl.sniff import check_safetensors, looks_like_path


def check_device(text: str, flag: str = "--device") -> str:
    """A device string torch understands, and that device present on this machine."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"{flag} {text!r}: not a device name (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cpu":
        return text
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "device_count"):
        raise UsageError(f"{flag} {text!r}: device type {device.type!r} is not supported here (cpu, cuda)")
    count = backend.device_count() if backend.is_available() else 0
    if count == 0:
        raise UsageError(f"{flag} {text!r}: no {device.type.upper()} device here (torch {torch.__version__})")
    if device.index is not None and device.index >= count:
        raise UsageError(f"{flag} {text!r}: there is no such device ({count} {device.type.upper()} device(s) here)")
    return text


FETCH_COMMAND = "python -m qerl.models fetch smollm2-135m-instruct --output DIR"


def _gguf_error(flag: str, name: str, gguf: Path) -> UsageError:
    return UsageError(
        f"{flag} {name}: {gguf.name} is a GGUF file (llama.cpp's format), which is not read here; pass a safetensors "
        f"model folder instead, such as the one `{FETCH_COMMAND}` makes of SmolLM2-135M-Instruct's GGUF"
    )


def check_causal_lm(config_path: Path, flag: str, name: str) -> None:
    """config.json names an architecture that transformers builds as a causal LM (what the loaders, the quantizer
    and generation need)."""
    try:
        config = json.loads(config_path.read_text())
    except ValueError as err:
        raise UsageError(f"{config_path}: not JSON ({err})") from None
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = config if isinstance(config, dict) else {}
    model_type = config.get("model_type")
    architecture = "/".join(config.get("architectures") or []) or "a model"
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UsageError(
            f"{flag} {name}: {architecture} of model_type {model_type!r}, unknown to transformers {__version__}"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(
            f"{flag} {name}: {architecture} (model_type {model_type!r}) is not a causal language model; these tools "
            "load decoder-only causal LMs (Llama, Qwen2, Mistral, ...)"
        )


def check_model(name: str, flag: str = "--model") -> str:
    """A local model folder (a causal LM, its safetensors files intact) or a hub id. A name that can only be a path
    and is missing is said so at once, without asking the hub; a GGUF file is named as such."""
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        raise _gguf_error(flag, name, path) if path.exists() else UsageError(f"{flag} {name}: no such file")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs and not any(path.glob("*.safetensors")):
            raise _gguf_error(flag, name, ggufs[0])
        if not (path / "config.json").is_file():
            raise UsageError(f"{flag} {name}: no config.json in this folder, so it is not a model checkpoint")
        check_causal_lm(path / "config.json", flag, name)
        for weights in sorted(path.glob("*.safetensors")):
            check_safetensors(weights)
        return str(path)
    if path.exists():
        raise UsageError(f"{flag} {name}: is a file; expected a model folder (or a hub id)")
    if looks_like_path(name):
        raise UsageError(f"{flag} {name}: no such folder")
    return name


def check_adapter(
    path: str, flag: str = "--adapter", model: str | None = None, model_flag: str = "--model", rank: int | None = None
) -> str:
    """A LoRA adapter folder, intact; given the base `model` (a local folder), one that fits it: an adapter trained
    on another base (or, given `rank`, at another LoRA rank) is named by its first module that does not fit."""
    folder = Path(path)
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: no such folder" if not folder.exists() else f"{flag} {path}: not a folder")
    config = folder / "adapter_config.json"
    if not config.is_file():
        raise UsageError(f"{flag} {path}: no adapter_config.json, so this is not a LoRA adapter folder")
    try:
        json.loads(config.read_text())
    except ValueError as err:
        raise UsageError(f"{config}: not JSON ({err})") from None
    headers = [check_safetensors(weights) for weights in sorted(folder.glob("*.safetensors"))]
    if model is not None and Path(model).is_dir():
        from qerl.nvfp4.checkpoint.format import logical_shapes

        base = logical_shapes(Path(model))
        for header in headers:
            _check_adapter_fits(header, base, f"{flag} {path}", f"{model_flag} {model}", rank)
    return path


_LORA = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")


def _check_adapter_fits(header: dict, base: dict[str, tuple], adapter: str, model: str, rank: int | None) -> None:
    """LoRA A [r, in] and B [out, r] of each module against the base's weight [out, in]; the other tensors (trained
    norms) against the base's tensor of the same name."""
    where = f"{adapter} does not fit {model}"
    lora: dict[str, dict[str, list[int]]] = {}
    for key, info in header.items():
        match = _LORA.match(key)
        if match:
            lora.setdefault(match.group(1), {})[match.group(2)] = info["shape"]
            continue
        name = key.removeprefix("base_model.model.")
        if name not in base:
            raise UsageError(f"{where}: the adapter has {name}, which the model does not")
        if tuple(info["shape"]) != base[name]:
            raise UsageError(f"{where}: {name} is {list(base[name])} in the model, {info['shape']} in the adapter")
    for module, ab in lora.items():
        a, b = ab.get("A", [0, 0]), ab.get("B", [0, 0])
        weight = base.get(f"{module}.weight")
        if weight is None:
            raise UsageError(f"{where}: the adapter has LoRA on {module}, which the model does not have")
        if (b[0], a[1]) != weight:
            raise UsageError(
                f"{where}: {module} is {list(weight)} (out, in) in the model, {[b[0], a[1]]} in the adapter (LoRA B "
                f"{b} x A {a}): trained on another base"
            )
        if rank is not None and a[0] != rank:
            raise UsageError(f"{adapter}: its LoRA rank is {a[0]}, --lora-rank is {rank}; pass --lora-rank {a[0]}")


def check_file(path: str, flag: str) -> str:
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such file")
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path}: not a file")
    return path


DATA_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv")


def jsonl_rows(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, row) of each non-blank line of a JSON Lines file; a line that is not a JSON object is one line
    naming the file and the line."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise UsageError(f"{path}, line {number}: not JSON ({err})") from None
            if not isinstance(row, dict):
                raise UsageError(f"{path}, line {number}: expected a JSON object per line, got {type(row).__name__}")
            yield number, row


def _jsonl_columns(path: str) -> list[str]:
    rows = [row for _, row in jsonl_rows(path)]  # every line read: a malformed one is named now, not mid-run
    if not rows:
        raise UsageError(f"{path}: no rows")
    return list(rows[0])


def data_file_columns(path: str, flag: str = "--dataset") -> list[str]:
    """The column names of a local data file, reading it through once to find malformed JSON by line."""
    check_file(path, flag)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        return _jsonl_columns(path)
    if ext == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                content = json.load(f)
        except ValueError:
            return _jsonl_columns(path)  # JSON Lines under a .json name, as `datasets` accepts
        if isinstance(content, list) and content and isinstance(content[0], dict):
            return list(content[0])
        if isinstance(content, dict) and content:
            return list(content)  # columnar: {"question": [...], "answer": [...]}
        raise UsageError(f"{path}: expected a list of rows or a mapping of columns")
    if ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(path).names)
        except Exception as err:  # pyarrow raises several types for a file that is not parquet
            raise UsageError(f"{path}: not a readable parquet file ({one_line(err)})") from None
    if ext == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), None)
        if not header:
            raise UsageError(f"{path}: empty CSV file")
        return header
    raise UsageError(f"{flag} {path}: unsupported file type {ext or '(none)'!r}; use {', '.join(DATA_EXTENSIONS)}")


def require_columns(path: str, columns: list[str], needed: Iterable[str], what: str) -> None:
    missing = [c for c in needed if c not in columns]
    if missing:
        raise UsageError(
            f"{path}: {what} needs column(s) {', '.join(missing)}, which are missing (columns: {', '.join(columns)})"
        )


HUB_TIMEOUT = 2.0  # seconds the hub has to answer before a dataset on it is called out of reach


def check_hub_dataset(repo_id: str, flag: str, name: str, local_rows: str | os.PathLike | None = None) -> None:
    """A dataset of the Hugging Face hub that can load: the hub answers within HUB_TIMEOUT, or `datasets` has it cached.
    Else one line naming `flag FILE` (and `local_rows`, the same kind of rows a clone carries), instead of datasets'
    ~30 s of retries and its traceback."""
    import httpx
    from datasets import config
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        HfApi(endpoint=config.HF_ENDPOINT).dataset_info(repo_id, timeout=HUB_TIMEOUT)
        return
    except HfHubHTTPError:
        return  # the hub answered (a gated or missing dataset): datasets says what it says
    except OfflineModeIsEnabled:
        why = "HF_HUB_OFFLINE is set"
    except httpx.TransportError as err:  # no connection, no name resolution, no answer in time
        why = f"no answer from {config.HF_ENDPOINT} within {HUB_TIMEOUT:g} s: {one_line(err) or type(err).__name__}"
    cached = Path(config.HF_DATASETS_CACHE) / "___".join(repo_id.split("/"))  # where datasets keeps what it loaded
    if any(path.is_dir() for path in cached.glob("*/*/*")):
        return
    instead = f"{flag} FILE (a local {' / '.join(DATA_EXTENSIONS)} file)"
    if local_rows is not None:
        relative = os.path.relpath(local_rows)  # as typed from the clone's root; a path from elsewhere
        instead += (
            f", such as the rows this clone carries: {flag} {local_rows if relative.startswith('..') else relative}"
        )
    raise UsageError(
        f"{flag} {name}: {repo_id} is on the Hugging Face hub, which is out of reach ({why}), and not in the datasets "
        f"cache; pass {instead}"
    )


def check_dataset(name: str, known: Sequence[str], flag: str) -> list[str] | None:
    """A dataset name: one of `known` (None), or a local data file, whose column names are returned. A name that is
    neither and cannot be a path (no such file, no data file extension, no folder in it) is refused, with the nearest
    known name."""
    if name in known:
        return None
    if not os.path.exists(name) and not name.lower().endswith(DATA_EXTENSIONS) and os.sep not in name:
        raise UsageError(
            f"{flag} {name}: unknown dataset{nearest(name, known)}; known datasets are {', '.join(known)}, or give "
            f"a local {' / '.join(DATA_EXTENSIONS)} file"
        )
    return data_file_columns(name, flag)
