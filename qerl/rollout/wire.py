"""What travels between the trainer and a rollout server (qerl/rollout/server.py, qerl/rollout/remote.py): the adapter
as one safetensors blob, a round's request and result as JSON, and the fingerprint of a base checkpoint. Pure: no
vLLM, no CUDA, no sockets.

AQN travels as its settings, seed, round and sigma (`NoiseSpec`, ~120 bytes), not as noisy norms: RoundNoise makes
the noise a pure function of them and of each norm's key, so the server draws it itself, and the digest of the noisy
norms it reads back (`norms_digest`) shows that it drew the trainer's. Each side checks what the other holds by
digest (`tensor_digest`) rather than by trusting a version number.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors.torch import load, save
from torch import nn

from qerl.aqn import NoiseStats, RoundNoise
from qerl.errors import UsageError
from qerl.rollout.vllm import adapter_tensors, lora_settings

PROTOCOL = 3  # bumped by any change either side must agree on; the handshake compares it (2: LoRA in BF16; 3: relabel)
_LORA, _NORMS = "lora/", "norms/"  # the blob's two parts: LoRA under peft's names, norms under vLLM's
# The dtype a server's engine holds LoRA in (vLLM's lora_dtype "auto" on a BF16 model). The trainer casts to it before
# sending: the server holds exactly what it would have made of FP32 masters, in half the bytes (1.5B, r16: 37 MB),
# and the digest compares what the engine holds. The norms stay FP32: the engine's norm scales are FP32.
SERVER_LORA_DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------------------------------------
# Digests


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """blake2b of each tensor's name, dtype, shape and raw bytes, in name order: equal only for bit-equal tensors of
    the same dtypes (BF16 included: the bytes are read as they are stored)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def adapter_digest(lora: dict[str, torch.Tensor], norms: dict[str, torch.Tensor]) -> str:
    return tensor_digest(_flat(lora, norms))


def norms_digest(model: nn.Module, noise: RoundNoise) -> str:
    """Digest of the norms `noise` perturbs in `model`, by noise key and in FP32: inside `noise.of_round`, the noisy
    norms, equal on the policy and on an engine's own model whichever dtype each stores its scales in."""
    keyed = noise.sites(model).keyed(noise.include_final, noise.include_head_norms)
    return tensor_digest({key: module.weight.detach().float() for key, module in keyed.items()})


# ----------------------------------------------------------------------------------------------------------
# The adapter


@dataclass(frozen=True)
class AdapterSnapshot:
    """The policy's adapter after `version` optimizer steps, on the CPU, as a server holds it: LoRA tensors under
    peft's names in SERVER_LORA_DTYPE, trained norms under vLLM's, and vLLM's LoRA settings
    (qerl.rollout.vllm.split_adapter_state, lora_settings)."""

    version: int
    lora: dict[str, torch.Tensor]
    norms: dict[str, torch.Tensor]
    settings: dict[str, Any]

    @functools.cached_property
    def digest(self) -> str:
        return adapter_digest(self.lora, self.norms)


def snapshot(policy: nn.Module, version: int) -> AdapterSnapshot:
    """The policy's adapter as it is now, copied: the optimizer steps that follow cannot change what is sent."""
    lora, norms = adapter_tensors(policy)
    return AdapterSnapshot(version, _cpu_copy(lora, SERVER_LORA_DTYPE), _cpu_copy(norms), lora_settings(policy))


def encode_adapter(snap: AdapterSnapshot) -> bytes:
    metadata = {"protocol": str(PROTOCOL), "version": str(snap.version), "lora_settings": json.dumps(snap.settings)}
    return save(_flat(snap.lora, snap.norms), metadata=metadata)


def decode_adapter(blob: bytes) -> AdapterSnapshot:
    metadata = _blob_metadata(blob)
    if metadata.get("protocol") != str(PROTOCOL):
        raise UsageError(f"adapter blob of protocol {metadata.get('protocol')}, this side speaks {PROTOCOL}")
    tensors = load(blob)
    parts = {
        prefix: {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}
        for prefix in (_LORA, _NORMS)
    }
    return AdapterSnapshot(int(metadata["version"]), parts[_LORA], parts[_NORMS], json.loads(metadata["lora_settings"]))


def _flat(lora: dict[str, torch.Tensor], norms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**{_LORA + n: t for n, t in lora.items()}, **{_NORMS + n: t for n, t in norms.items()}}


def _cpu_copy(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    return {
        n: t.detach().to("cpu", dtype or t.dtype, memory_format=torch.contiguous_format, copy=True)
        for n, t in tensors.items()
    }


def _blob_metadata(blob: bytes) -> dict[str, str]:
    return _header(io.BytesIO(blob)).get("__metadata__", {})


# ----------------------------------------------------------------------------------------------------------
# A round


@dataclass(frozen=True)
class NoiseSpec:
    """A round's AQN: what RoundNoise(seed, include_final, dtype_rule, include_head_norms).of_round(model, sigma,
    round) needs, the trainer's settings as they are."""

    sigma: float
    round: tuple[int, int]  # (optimizer step, round within it)
    seed: int
    include_final: bool
    include_head_norms: bool
    dtype_rule: str

    @classmethod
    def of(cls, noise: RoundNoise, sigma: float, noise_round: tuple[int, int]) -> NoiseSpec:
        return cls(
            float(sigma),
            tuple(noise_round),
            noise.seed,
            noise.include_final,
            noise.include_head_norms,
            noise.dtype_rule,
        )

    @property
    def settings(self) -> tuple[int, bool, str, bool]:
        """RoundNoise's arguments, in its order: what stays the same over a run's rounds."""
        return self.seed, self.include_final, self.dtype_rule, self.include_head_norms

    def round_noise(self) -> RoundNoise:
        """The RoundNoise of these settings, one per process and settings: it finds a model's norms once, where a new
        one each round would walk the model's modules again (the server's engine, the trainer's policy)."""
        return _round_noise(*self.settings)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NoiseSpec:
        return cls(**{**data, "round": tuple(data["round"])})


@functools.lru_cache(maxsize=8)
def _round_noise(seed: int, include_final: bool, dtype_rule: str, include_head_norms: bool) -> RoundNoise:
    return RoundNoise(seed, include_final, dtype_rule, include_head_norms)


@dataclass(frozen=True)
class RoundRequest:
    round: int  # the trainer's round index: what staleness is counted against
    adapter_version: int  # the adapter the round must be sampled with
    noise: NoiseSpec
    sampling: dict[str, Any]  # vLLM SamplingParams keywords (qerl.rollout.vllm.sampling_kwargs)
    prompt_ids: list[list[int]]

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "noise": self.noise.as_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundRequest:
        return cls(**{**data, "noise": NoiseSpec.from_json(data["noise"])})


@dataclass(frozen=True)
class RoundResult:
    completion_ids: list[list[int]]  # cut after the first EOS (truncate_at_eos)
    logprobs: list[list[float]]
    adapter_version: int
    noise: NoiseStats
    noise_digest: str  # norms_digest of the noisy norms, read back during the round
    server: str  # who sampled it (a merged result: every server, in prompt order)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundResult:
        return cls(**{**data, "noise": NoiseStats(**data["noise"])})


# ----------------------------------------------------------------------------------------------------------
# The base

# config.json keys that say who wrote the file, not what the model is: two copies of one base may differ in them.
_WRITER_KEYS = ("transformers_version", "_name_or_path")


def base_fingerprint(model_path: str) -> str:
    """A digest of the checkpoint's config.json (its quantization_config included) and of its safetensors headers
    (tensor names, dtypes, shapes): equal for the same base however it is sharded or where it lies; another model,
    size, quantization or architecture differs. No weight is read, so it is cheap on any size, and two bases alike in
    every name and shape but not in their values share it (the path in the server's info tells those apart)."""
    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors"))
    missing = "config.json" if not (folder / "config.json").is_file() else "*.safetensors file" if not files else None
    if missing:
        raise UsageError(f"base checkpoint {model_path} has no {missing}: give the folder the policy was loaded from")
    config = json.loads((folder / "config.json").read_text())
    config = {key: value for key, value in config.items() if key not in _WRITER_KEYS}
    headers = dict(item for file in files for item in _tensor_shapes(file).items())
    text = json.dumps({"config": config, "tensors": headers}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _tensor_shapes(file: Path) -> dict[str, list]:
    """name -> [dtype, shape] of every tensor of a safetensors file, from its header alone."""
    with open(file, "rb") as f:
        header = _header(f)
    return {name: [entry["dtype"], entry["shape"]] for name, entry in header.items() if name != "__metadata__"}


def _header(stream: BinaryIO) -> dict[str, Any]:
    """A safetensors header: a little-endian u64 N, then N bytes of JSON (tensor entries and __metadata__)."""
    (size,) = struct.unpack("<Q", stream.read(8))
    return json.loads(stream.read(size))
