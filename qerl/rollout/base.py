"""The rollout backends' interface: a backend's settings and setup, what a round returns, the base class, and the
error a backend raises for a model or set-up it cannot run. Each backend (transformers.py, vllm.py, native/) imports
this module; the package's __init__ registers them and picks one (create_backend), re-exporting these names."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from qerl.errors import UsageError

Perturb = Callable[[nn.Module], AbstractContextManager]


@dataclass(frozen=True)
class NativeSettings:
    """The native engine's settings (qerl/rollout/native)."""

    kv_cache_gib: float | None = None  # KV-cache memory a round may take (None: 80% of what is free); waves past it
    kv_cache_dtype: str = "auto"  # field_rules.KV_CACHE_DTYPES
    compact_rows: bool = False  # decode only the live rows once at most half are (engine.py)
    keep_between_rounds: bool | None = None  # a round's KV cache and steps kept for the next (None: by memory)


@dataclass(frozen=True)
class TransformersSettings:
    """The transformers backend's settings (qerl/rollout/transformers.py)."""

    batch_size: int | None = None  # prompts per generate() call (None: the whole round at once)


@dataclass(frozen=True)
class VLLMSettings:
    """The vLLM engine's settings: qerl.rollout.vllm.VLLMEngine's keywords."""

    gpu_memory_utilization: float = 0.3  # vLLM's share of the card (weights, KV cache, graphs)
    max_model_len: int | None = None  # the engine's context (None: the model's)
    max_num_seqs: int | None = None  # sequences per batch (None: vLLM's default)
    sleep: bool = True  # sleep mode between rounds: the KV cache freed, weights parked in CPU memory
    fp32_norms: bool = True  # FP32 norm scales, so that small AQN noise survives (the fp32 noise rule)
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs


@dataclass(frozen=True)
class ServerSettings:
    """The rollout servers' settings (qerl/rollout/server_backend.py)."""

    urls: tuple[str, ...] = ()  # http://HOST:PORT of each server (python -m qerl.rollout_server), one per GPU
    timeout: float = 600.0  # seconds a call, or the wait for the servers at the start, may take
    max_staleness: int = 0  # 1: a round may be sampled ahead, with the adapter of the step before its own


@dataclass
class RolloutSetup:
    """Everything a backend needs from the trainer (or from evaluation, a benchmark), once. The trainer fills every
    engine's settings, since `auto` decides only when the backend is built."""

    generation_config: GenerationConfig  # max_new_tokens and the sampling settings (temperature, top-k/p, min-p)
    eos_token_ids: list[int]
    pad_token_id: int
    # Opens the policy for sampling (unwrapped from DDP/FSDP/ZeRO, parameters gathered) and yields it. None: no
    # policy in memory, only a checkpoint folder (and adapter) that an engine with its own copy loads (for_checkpoint).
    open_policy: Callable[[], AbstractContextManager[nn.Module]] | None
    device: torch.device
    model_path: str | None = None  # checkpoint folder the base was loaded from, for engines with their own copy
    adapter_path: str | None = None  # with no policy in memory: the saved adapter the engine samples with
    pad_to_multiple_of: int | None = None
    # How the run shards the policy's parameters: "fsdp2", "zero3", or None (whole on every rank). An engine that
    # reads the policy's own tensors gathers them every round.
    sharding: str | None = None
    native: NativeSettings = field(default_factory=NativeSettings)
    transformers: TransformersSettings = field(default_factory=TransformersSettings)
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    server: ServerSettings = field(default_factory=ServerSettings)

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        generation_config: GenerationConfig,
        eos_token_ids: list[int],
        pad_token_id: int,
        **fields,
    ) -> RolloutSetup:
        """A setup on a model held outside a trainer (evaluation, benchmarks): opening the policy yields the model as
        it is, on the device of its parameters."""
        return cls(
            generation_config,
            eos_token_ids,
            pad_token_id,
            open_policy=lambda: contextlib.nullcontext(model),
            device=next(model.parameters()).device,
            **fields,
        )

    @classmethod
    def for_checkpoint(
        cls,
        model_path: str,
        adapter_path: str | None,
        generation_config: GenerationConfig,
        eos_token_ids: list[int],
        pad_token_id: int,
        **fields,
    ) -> RolloutSetup:
        """A setup on a checkpoint folder and a saved adapter, with no policy in memory: for an engine that loads its
        own copy (vllm). Evaluation samples from a trained adapter this way."""
        return cls(
            generation_config,
            eos_token_ids,
            pad_token_id,
            open_policy=None,
            device=torch.device("cuda"),
            model_path=model_path,
            adapter_path=adapter_path,
            **fields,
        )


def no_noise(module: nn.Module) -> AbstractContextManager:
    """The `perturb` of a round without AQN."""
    return contextlib.nullcontext()


@dataclass
class RolloutOutput:
    completion_ids: list[list[int]]  # up to and including the first EOS
    logprobs: list[list[float]]  # one per completion token, under the (noisy) rollout policy
    noise: Any = None  # what `perturb` yielded (qerl.aqn.NoiseStats)
    adapter_version: int | None = None  # the optimizer steps of the adapter that sampled (rollout servers), else None


@torch.no_grad()
def copy_norms(params: dict[str, torch.Tensor], norms: dict[str, torch.Tensor], model_name: str) -> None:
    """The trained norm scales, under vLLM's names (transformers' own, without peft's prefix), into an engine's
    parameters of those names (`params`); a name the engine lacks is an error naming `model_name`."""
    for name, value in norms.items():
        if name not in params:
            raise KeyError(f"trained norm {name!r} has no counterpart in {model_name}")
        params[name].copy_(value)


def truncate_at_eos(completion_ids: list[list[int]], logprobs: list[list[float]], eos_token_ids) -> RolloutOutput:
    """Keep each completion up to and including its first EOS (what follows is padding, or nothing)."""
    eos = set(eos_token_ids)
    ids_out, lps_out = [], []
    for ids, lps in zip(completion_ids, logprobs, strict=True):
        n = next((i + 1 for i, token in enumerate(ids) if token in eos), len(ids))
        ids_out.append(ids[:n])
        lps_out.append(lps[:n])
    return RolloutOutput(ids_out, lps_out)


class RolloutBackend(ABC):
    name: str
    samples_from_checkpoint = False  # can run on a setup with no policy in memory (RolloutSetup.for_checkpoint)

    def __init__(self, setup: RolloutSetup):
        self.setup = setup

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], perturb: Perturb) -> RolloutOutput: ...


class Unsupported(UsageError):
    """A backend cannot run this model or set-up (auto then falls back to the next choice; a backend asked for by
    name stops the run in one line, see qerl.cli)."""
