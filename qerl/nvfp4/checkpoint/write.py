"""Writing checkpoint folders: size-capped safetensors shards, in a folder that appears only once complete.

Both writers use it: `save_nvfp4_checkpoint` (a model quantized in memory) and the streaming quantizer
(qerl.nvfp4.quantize_checkpoint). A run that fails or is killed leaves no half-written checkpoint behind, and
`overwrite` never removes anything but an empty folder or a checkpoint written here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from qerl.nvfp4 import DEFAULT_SHARD_BYTES
from qerl.nvfp4.checkpoint.format import INDEX_FILE, SINGLE_FILE, CheckpointError, quantization_config
from qerl.nvfp4.linear import NVFP4Linear
from qerl.nvfp4.quantize import quantization_targets

# Written into every checkpoint folder written here: the only non-empty folders `overwrite` may replace.
WRITTEN_MARKER = ".qerl-nvfp4-checkpoint"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

logger = logging.getLogger(__name__)


class ShardWriter:
    """Collects tensors and writes `model-0000i-of-0000n.safetensors` shards of at most `max_bytes`."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        # A copy of our own: a tensor read from safetensors is a view that keeps its whole shard mapped.
        self.pending[name] = tensor.detach().to("cpu").contiguous().clone()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        file_name = f"shard-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(self.out_dir / file_name), metadata={"format": "pt"})
        self.written.append((file_name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Give the shards their final names and write the index (or a single model.safetensors)."""
        self.flush()
        if len(self.written) == 1:
            os.rename(self.out_dir / self.written[0][0], self.out_dir / SINGLE_FILE)
            return
        weight_map = {}
        for i, (tmp_name, names) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{len(self.written):05d}.safetensors"
            os.rename(self.out_dir / tmp_name, self.out_dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(self.out_dir / INDEX_FILE, "w") as f:
            json.dump(index, f, indent=2)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class AtomicOutputDir:
    """Write into a hidden sibling folder and rename it into place only when everything succeeded.

    Nothing is removed that the caller did not ask to replace: `overwrite` replaces an empty folder or a
    checkpoint written here (it holds WRITTEN_MARKER), never a file, never a folder holding `source`, never
    a folder with other contents. Hidden work folders of killed runs (their process is gone) are removed, saying so.
    """

    def __init__(
        self,
        output: str | os.PathLike,
        overwrite: bool,
        source: str | os.PathLike | None = None,
        writer: str = "quantize_nvfp4.py / qerl.nvfp4.checkpoint",
    ):
        self.final = Path(output).resolve()
        self.writer = writer
        # The input as named and as resolved: a folder holding a link to the model holds the model too.
        for src in {Path(os.path.abspath(source)), Path(source).resolve()} if source is not None else ():
            if self.final == src or self.final in src.parents:
                raise CheckpointError(f"--output {self.final}: holds the input model {src}; choose a folder outside it")
        for parent in self.final.parents:
            if parent.exists() and not parent.is_dir():
                raise CheckpointError(f"--output {self.final}: {parent} is a file, not a folder")
        if self.final.exists():
            if not self.final.is_dir():
                raise CheckpointError(f"--output {self.final}: is a file; choose a folder path")
            if not overwrite:
                raise CheckpointError(f"--output {self.final}: folder exists; pass --overwrite to replace it")
            if any(self.final.iterdir()) and not (self.final / WRITTEN_MARKER).is_file():
                raise CheckpointError(
                    f"--output {self.final}: not empty and not a checkpoint this tool wrote, so --overwrite will not "
                    "replace it; remove it yourself or choose another folder"
                )
        self.tmp = self._sibling("partial", os.getpid())

    def _sibling(self, kind: str, pid: int | str) -> Path:
        return self.final.parent / f".{self.final.name}.{kind}-{pid}"

    def _remove_stale(self) -> None:
        kinds = ("partial", "old") if self.final.exists() else ("partial",)  # an .old- folder may be all there is
        for kind in kinds:
            for stale in sorted(self.final.parent.glob(self._sibling(kind, "*").name)):
                pid = stale.name.rsplit("-", 1)[1]
                if pid.isdigit() and int(pid) != os.getpid() and not _process_alive(int(pid)):
                    shutil.rmtree(stale, ignore_errors=True)
                    logger.warning(
                        "removed %s, left behind by an earlier run (process %s) that did not finish", stale, pid
                    )

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._remove_stale()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        (self.tmp / WRITTEN_MARKER).write_text(f"written by qerl ({self.writer})\n")
        if self.final.exists():  # the old output goes only once the new one is in place
            old = self._sibling("old", os.getpid())
            os.rename(self.final, old)
            os.rename(self.tmp, self.final)
            shutil.rmtree(old)
        else:
            os.rename(self.tmp, self.final)
        return False


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy what a model folder holds besides weights and config.json: tokenizer files, generation_config.json
    (stop tokens, sampling defaults), chat template, license, ..."""
    for extra in sorted(src.iterdir()):
        if (
            extra.is_file()
            and extra.name not in ("config.json", INDEX_FILE, WRITTEN_MARKER)
            and extra.suffix not in _WEIGHT_SUFFIXES
        ):
            shutil.copy2(extra, dst / extra.name)


def write_config(config: dict, out_dir: Path, ignore) -> None:
    config = dict(config)
    config["quantization_config"] = quantization_config(ignore)
    with open(out_dir / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def save_nvfp4_checkpoint(
    model: nn.Module,
    output: str | os.PathLike,
    tokenizer=None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a model holding NVFP4Linear modules as a compressed-tensors checkpoint folder."""
    if hasattr(model, "peft_config"):
        raise TypeError("save_nvfp4_checkpoint takes the base model; save LoRA adapters with peft's save_pretrained")
    quantized = {name for name, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    if not quantized:
        raise ValueError(f"{type(model).__name__} holds no NVFP4Linear; quantize it first (qerl.nvfp4.quantize)")
    ignore = [name for name in quantization_targets(model, ignore=())]  # Linears kept in BF16
    with AtomicOutputDir(output, overwrite) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        seen: set[int] = set()
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() in seen and tensor.numel() > 0:  # tied weights are stored once
                continue
            seen.add(tensor.data_ptr())
            writer.add(name, tensor)
        writer.finish()
        config = model.config.to_dict()
        # The model's own class, as save_pretrained records it. A config built in memory (from_config) has none,
        # and vLLM then takes the base-model class of the model type (Qwen3Model, Gemma3TextModel) and builds an
        # embedding model from the folder instead of the causal LM.
        config["architectures"] = [type(model).__name__.removeprefix("FSDP")]
        write_config(config, tmp, ignore)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(output).resolve()
