"""compressed-tensors `nvfp4-pack-quantized` checkpoints: load, save, and quantize a BF16 checkpoint.

A checkpoint is a transformers model folder whose config.json carries the quantization_config that
llmcompressor writes, and whose safetensors hold, for each quantized Linear, `weight_packed`,
`weight_scale` and `weight_global_scale` instead of `weight`. compressed-tensors decompresses such a
folder and vLLM serves it; we load it straight into NVFP4Linear modules without ever building the
BF16 weights, and write it shard by shard, layer by layer, so that neither direction needs the whole
model in memory.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import sys
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from qerl.cli import UsageError, check_safetensors, looks_like_path
from qerl.nvfp4 import codec
from qerl.nvfp4.linear import NVFP4Linear
from qerl.nvfp4.quantize import DEFAULT_IGNORE, global_scales, quantization_targets

FORMAT = "nvfp4-pack-quantized"
QUANT_METHOD = "compressed-tensors"
COMPRESSED_TENSORS_VERSION = "0.19.0"  # the version llmcompressor 0.14 pins and writes
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 * 1024**3
_PACKED_SUFFIX = ".weight_packed"
_LAYER_PREFIX = re.compile(r"^(.*\.layers\.\d+)\.")
# Written into every checkpoint folder this module writes: the only non-empty folders `overwrite` may replace.
WRITTEN_MARKER = ".qerl-nvfp4-checkpoint"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

logger = logging.getLogger(__name__)


class CheckpointError(UsageError):
    """A checkpoint folder that cannot be read or written as asked; the message names the file or tensor at fault."""


def quantization_config(ignore=DEFAULT_IGNORE) -> dict:
    """config.json's quantization_config for NVFP4A16, field for field as llmcompressor 0.14 writes it."""
    return {
        "config_groups": {
            "group_0": {
                "format": FORMAT,
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": codec.GROUP_SIZE,
                    "num_bits": 4,
                    "observer": "memoryless_minmax",
                    "observer_kwargs": {},
                    "scale_dtype": "torch.float8_e4m3fn",
                    "strategy": "tensor_group",
                    "symmetric": True,
                    "type": "float",
                    "zp_dtype": None,
                },
            }
        },
        "format": FORMAT,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": QUANT_METHOD,
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def check_quantization_config(config: dict, config_path: Path) -> dict:
    """Return the quantization_config of an NVFP4A16 checkpoint, or raise naming what it is instead."""
    qcfg = config.get("quantization_config")
    if qcfg is None:
        raise CheckpointError(
            f"{config_path}: no quantization_config, so this is not a quantized checkpoint. Load it as BF16, "
            "or quantize it first: python llm-compressor/quantize_nvfp4.py --model DIR --output OUT"
        )
    method = qcfg.get("quant_method")
    if method != QUANT_METHOD:
        raise CheckpointError(f"{config_path}: quant_method is {method!r}; only {QUANT_METHOD!r} NVFP4 is supported")
    fmt = qcfg.get("format")
    for group_name, group in qcfg.get("config_groups", {}).items():
        weights = group.get("weights") or {}
        if group.get("input_activations"):
            raise CheckpointError(f"{config_path}: config group {group_name!r} quantizes activations; we read W4A16")
        spec = (weights.get("num_bits"), weights.get("type"), weights.get("group_size"))
        group_format = group.get("format") or fmt
        if spec != (4, "float", codec.GROUP_SIZE) or group_format != FORMAT:
            raise CheckpointError(
                f"{config_path}: config group {group_name!r} is {group_format} with num_bits={spec[0]}, "
                f"type={spec[1]}, group_size={spec[2]}; expected {FORMAT} (NVFP4A16: 4-bit float, groups of 16)"
            )
    if fmt != FORMAT and fmt != "mixed-precision":
        raise CheckpointError(f"{config_path}: format is {fmt!r}, expected {FORMAT!r}")
    if qcfg.get("quantization_status") != "compressed":
        raise CheckpointError(
            f"{config_path}: quantization_status is {qcfg.get('quantization_status')!r}, expected 'compressed'"
        )
    return qcfg


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id, fetched (or found in the cache) through huggingface_hub."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path}: expected a model folder, found a file")
    if looks_like_path(str(name_or_path)):
        raise CheckpointError(f"{path}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                str(name_or_path), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
            )
        )
    except Exception as err:  # offline, unknown id, gated repo: say which, keep the cause
        raise CheckpointError(f"{name_or_path}: not a local folder and not downloadable from the hub ({err})") from err


def read_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing; a model folder needs its config.json")
    with open(config_path) as f:
        return json.load(f)


def tensor_index(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single-file or sharded folder; every shard must exist."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        shards = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(shards.values())):
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {index_path} is missing")
            check_safetensors(shard)
        return shards
    single = model_dir / SINGLE_FILE
    if single.is_file():
        check_safetensors(single)
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in model_dir.glob("*.bin")) or sorted(p.name for p in model_dir.iterdir())
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (found: {', '.join(found) or 'nothing'})")


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The architecture with its parameters on the meta device; real (small) buffers such as rotary tables."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=value.is_floating_point())
    elif attr in module._buffers:
        module._buffers[attr] = value
    else:
        raise CheckpointError(f"{name}: the checkpoint has this tensor but the model has no such parameter")


def load_nvfp4_model(
    name_or_path: str | os.PathLike,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """Load an NVFP4A16 checkpoint into a transformers causal LM whose quantized Linears are NVFP4Linear.

    Tensors go from the safetensors shards straight to `device` (default: cuda if available); the
    quantized weights are never expanded, so peak memory stays close to the packed size.
    """
    from transformers import AutoConfig, GenerationConfig

    model_dir = resolve_model_dir(name_or_path)
    check_quantization_config(read_config(model_dir), model_dir / "config.json")
    index = tensor_index(model_dir)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    config = AutoConfig.from_pretrained(model_dir)
    model = _meta_model(config, dtype)
    if (model_dir / "generation_config.json").is_file():  # stop tokens and sampling defaults, as for a BF16 load
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    for packed_name in (n for n in index if n.endswith(_PACKED_SUFFIX)):
        module_name = packed_name[: -len(_PACKED_SUFFIX)]
        try:
            old = model.get_submodule(module_name)
        except AttributeError:
            raise CheckpointError(f"{packed_name}: no module {module_name!r} in {type(model).__name__}") from None
        if not isinstance(old, nn.Linear):
            raise CheckpointError(f"{packed_name}: {module_name!r} is a {type(old).__name__}, not a Linear")
        parent_name, _, child = module_name.rpartition(".")
        new = NVFP4Linear(old.in_features, old.out_features, old.bias is not None, "meta", dtype)
        setattr(model.get_submodule(parent_name), child, new)

    expected = dict(model.state_dict(keep_vars=True))
    by_shard: dict[Path, list[str]] = defaultdict(list)
    for name, shard in index.items():
        if name not in expected:
            raise CheckpointError(f"{shard}: tensor {name!r} matches nothing in {type(model).__name__}")
        by_shard[shard].append(name)
    for shard, names in tqdm(sorted(by_shard.items()), desc=f"Loading {model_dir.name}", unit="shard"):
        with safe_open(shard, "pt", device="cpu") as f:
            for name in names:
                value = f.get_tensor(name)
                _check_finite(name, value, shard)
                want = expected[name]
                if value.shape != want.shape:
                    raise CheckpointError(
                        f"{shard}: {name} has shape {tuple(value.shape)}, the model expects {tuple(want.shape)}"
                    )
                if want.is_floating_point() and want.dtype in (torch.float32, torch.bfloat16, torch.float16):
                    value = value.to(want.dtype)
                elif value.dtype != want.dtype:
                    raise CheckpointError(f"{shard}: {name} is {value.dtype}, expected {want.dtype}")
                _set_tensor(model, name, value.to(device))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if missing:
        raise CheckpointError(
            f"{model_dir}: tensors missing from the checkpoint: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            module.reset_splitk_counters(device)  # scratch, not in the checkpoint: still on meta
    model.to(device)  # the buffers that were built rather than loaded (rotary tables)
    model.eval()
    return model


class _ShardWriter:
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


class _AtomicOutputDir:
    """Write into a hidden sibling folder and rename it into place only when everything succeeded.

    Nothing is removed that the caller did not ask to replace: `overwrite` replaces an empty folder or a
    checkpoint this module wrote (it holds WRITTEN_MARKER), never a file, never a folder holding `source`, never
    a folder with other contents. Hidden work folders of killed runs (their process is gone) are removed, saying so.
    """

    def __init__(self, output: str | os.PathLike, overwrite: bool, source: str | os.PathLike | None = None):
        self.final = Path(output).resolve()
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
                    logger.warning("removed %s, left behind by an earlier run (process %s) that did not finish",
                                   stale, pid)  # fmt: skip

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
        (self.tmp / WRITTEN_MARKER).write_text("written by qerl (quantize_nvfp4.py / qerl.nvfp4.checkpoint)\n")
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


def _check_finite(name: str, tensor: torch.Tensor, shard: Path) -> None:
    if tensor.is_floating_point():
        values = tensor.float() if tensor.element_size() == 1 else tensor  # isfinite has no FP8 kernels
        if not torch.isfinite(values).all():
            raise CheckpointError(f"{shard}: tensor {name} contains NaN or Inf")


def _write_config(config: dict, out_dir: Path, ignore) -> None:
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
    with _AtomicOutputDir(output, overwrite) as tmp:
        writer = _ShardWriter(tmp, max_shard_bytes)
        seen: set[int] = set()
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() in seen and tensor.numel() > 0:  # tied weights are stored once
                continue
            seen.add(tensor.data_ptr())
            writer.add(name, tensor)
        writer.finish()
        _write_config(model.config.to_dict(), tmp, ignore)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(output).resolve()


def _read_tensors(index: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Read `names` from their shards, opening each only for this read: a shard left open stays mapped,
    and its pages would count against the memory we promise to stay within."""
    tensors = {}
    with ExitStack() as stack:
        handles = {
            shard: stack.enter_context(safe_open(shard, "pt", device="cpu")) for shard in {index[n] for n in names}
        }
        for name in names:
            tensors[name] = handles[index[name]].get_tensor(name)
    return tensors


def _return_freed_memory() -> None:
    """Hand freed heap memory back to the OS between layers. glibc keeps freed blocks of a few tens of MB
    in its heap (its mmap threshold rises after the first large free), so without this the resident size
    of a layer-by-layer loop creeps up by about a layer each step."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # another C library (musl): nothing to trim
            pass


def _group_by_layer(names) -> list[list[str]]:
    """Tensor names grouped by decoder layer (fused siblings always share one), other tensors last."""
    layers: dict[str, list[str]] = defaultdict(list)
    rest: list[str] = []
    for name in names:
        match = _LAYER_PREFIX.match(name)
        (layers[match.group(1)] if match else rest).append(name)
    ordered = sorted(layers, key=lambda p: [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", p)])
    return [layers[p] for p in ordered] + ([rest] if rest else [])


@torch.no_grad()
def quantize_checkpoint(
    model: str | os.PathLike,
    output: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    ignore=DEFAULT_IGNORE,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Quantize a BF16 (or FP16/FP32) checkpoint folder to NVFP4A16, one decoder layer at a time.

    Memory: one layer's weights plus one output shard, whatever the model size. Which Linears are
    quantized comes from the architecture (every nn.Linear but `ignore`), as in llmcompressor's recipe.
    """
    from transformers import AutoConfig

    src = resolve_model_dir(model)
    config = read_config(src)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise CheckpointError(f"{src / 'config.json'}: already quantized ({method}); give a BF16 checkpoint")
    output_dir = _AtomicOutputDir(output, overwrite, source=src)
    index = tensor_index(src)
    meta = _meta_model(AutoConfig.from_pretrained(src), dtype)
    targets = {f"{name}.weight" for name in quantization_targets(meta, ignore)}
    absent = sorted(targets - index.keys())
    if absent:
        raise CheckpointError(f"{src}: checkpoint lacks Linear weights the architecture has: {', '.join(absent[:8])}")
    for name in sorted(targets):  # before any work: the shapes come from the config
        in_features = meta.get_submodule(name[: -len(".weight")]).in_features
        if in_features % codec.GROUP_SIZE:
            raise CheckpointError(
                f"{name} ({index[name].name}): in_features={in_features} is not divisible by the NVFP4 group size "
                f"{codec.GROUP_SIZE}; keep this Linear in BF16 with --ignore"
            )

    with output_dir as tmp:
        writer = _ShardWriter(tmp, max_shard_bytes)
        for names in tqdm(_group_by_layer(index), desc=f"Quantizing {src.name}", unit="layer"):
            _return_freed_memory()
            tensors = _read_tensors(index, names)
            for name, tensor in tensors.items():
                _check_finite(name, tensor, index[name])
                if tensor.is_floating_point() and name not in targets:
                    writer.add(name, tensor.to(dtype))
                elif name not in targets:
                    writer.add(name, tensor)
            weights = {n[: -len(".weight")]: tensors[n].to(device=device, dtype=dtype) for n in names if n in targets}
            for module_name, scale in global_scales(weights).items():
                q = codec.quantize(
                    weights[module_name], scale, name=f"{module_name}.weight ({index[module_name + '.weight'].name})"
                )
                writer.add(f"{module_name}.weight_packed", q.packed)
                writer.add(f"{module_name}.weight_scale", q.scale)
                writer.add(f"{module_name}.weight_global_scale", q.global_scale.clone())  # fused siblings share one
        writer.finish()
        _write_config(config, tmp, ignore)
        copy_side_files(src, tmp)
    return Path(output).resolve()
