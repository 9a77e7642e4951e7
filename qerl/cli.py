"""The convention of the command-line tools (llm-compressor/quantize_nvfp4.py, `python -m qerl.train`,
`python -m eval.gsm8k` / `eval.math`): a user's mistake is one line on stderr and exit code 2, found before
anything heavy loads; an error of the program itself keeps its traceback. `--debug` (or QERL_DEBUG=1) shows
the traceback of user errors too.

Also here: the checks of flags and input files that those tools share. Nothing here imports torch at module
level, so a tool can validate before it pays for the heavy imports.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import difflib
import json
import math
import os
import re
import signal
import struct
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

DEBUG_ENV = "QERL_DEBUG"


class UsageError(ValueError):
    """A mistake in the flags or the input files. Its message names the culprit (and the fix, where known)."""


def one_line(message: object) -> str:
    return " ".join(str(message).split())


def run_cli(main: Callable[[list[str]], int | None], prog: str, argv: list[str] | None = None) -> int:
    """Run `main(argv)` under the convention above; returns the exit code (sys.exit it). SIGINT and SIGTERM
    unwind the run (half-written outputs are removed on the way out) and end it in one line, exit code 128 + the
    signal's number."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, _interrupt) for signum in INTERRUPTS}
    try:
        return main(argv) or 0
    except UsageError as err:
        if debug:
            raise
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        if debug:
            raise
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"{prog}: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised like Ctrl-C so that every `finally` on the way out runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until the block ends and then take effect: what the block writes (a checkpoint) is
    written whole. Python runs signal handlers in the main thread only, so elsewhere this defers nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {signum: signal.signal(signum, lambda got, frame: caught.append(got)) for signum in INTERRUPTS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)  # now to the handler in force again


# ----------------------------------------------------------------------------------------------------------
# Flags


def nearest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or ''."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def reject_unknown_flags(argv: list[str], known: Iterable[str]) -> None:
    known = set(known)
    for arg in argv:
        if arg == "--":
            return
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            raise UsageError(f"unknown flag {flag}{nearest(flag, sorted(k for k in known if k.startswith('--')))}")


def attach_negative_numbers(argv: list[str]) -> list[str]:
    """`--flag -1e-5` -> `--flag=-1e-5`: argparse takes a negative number in scientific notation for a flag."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and arg.startswith("-") and _is_number(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class ParserErrors:
    """Mixin for argparse parsers: errors become UsageErrors (one line, no usage dump), and a misspelt flag is
    named with the nearest valid one before any other complaint (such as a missing required flag)."""

    def known_flags(self) -> list[str]:
        return list(self._option_string_actions)

    def parse_args(self, args=None, namespace=None):
        args = attach_negative_numbers(list(sys.argv[1:] if args is None else args))
        reject_unknown_flags(args, self.known_flags())
        return super().parse_args(args, namespace)

    def error(self, message):
        raise UsageError(message)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default after its help (unless it has none: required flags, switches); the description keeps
    its line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


class ArgumentParser(ParserErrors, argparse.ArgumentParser):
    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(allow_abbrev=False, **kwargs)
        self.add_argument("--debug", action="store_true", help="show the traceback of user errors too")


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts, and why where it is not obvious. Also an argparse `type`."""

    kind: type  # int or float
    low: float
    high: float | None = None
    low_open: bool = False  # low itself is refused
    high_open: bool = False
    special: tuple = ()  # values accepted outside [low, high], such as max_steps' -1
    why: str = ""

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        low, high = (b if b is None else str(int(b)) if self.kind is int else f"{b:g}" for b in (self.low, self.high))
        if high is None:
            text = f"{what} {'>' if self.low_open else '>='} {low}"
        else:
            text = f"{what} in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        text += "".join(f", or {value}" for value in self.special)
        return f"{text} ({self.why})" if self.why else text

    def problem(self, value) -> str | None:
        """Why `value` is refused ('must be ..., got ...'), or None."""
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if is_number and value in self.special:
            return None
        fits = (
            is_number
            and (self.kind is float or float(value).is_integer())
            and math.isfinite(value)
            and (value > self.low if self.low_open else value >= self.low)
            and (self.high is None or (value < self.high if self.high_open else value <= self.high))
        )
        if fits:
            return None
        return f"must be {self.describe()}, got {f'{value:g}' if isinstance(value, float) else repr(value)}"

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value


COUNT = Range(int, 1)
COUNT_OR_ZERO = Range(int, 0)
POSITIVE = Range(float, 0, low_open=True)
NON_NEGATIVE = Range(float, 0)
FRACTION = Range(float, 0, 1)
SEED = Range(int, 0, 2**32 - 1)  # numpy's seed range (transformers seeds numpy too)


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


# ----------------------------------------------------------------------------------------------------------
# Files

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


def _jsonl_columns(path: str) -> list[str]:
    columns = None
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
            columns = columns if columns is not None else list(row)
    if columns is None:
        raise UsageError(f"{path}: no rows")
    return columns


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
