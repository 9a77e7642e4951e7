"""Rollout backends: what generates the completions of a GRPO round, behind one small interface.

A backend is built once from a `RolloutSetup` (sampling settings, a way to open the policy, the checkpoint
the base came from) and then, every generation round, takes token-id prompts and a `perturb` context
factory (AQN: applied to the module the backend actually samples from, restored after). It returns the
completion ids, the log-probability of every sampled token under the policy that sampled it (after
temperature and the other sampling filters: what TRL's importance-sampling correction and `sampling/*`
metrics consume) and the noise statistics that `perturb` yielded.

    transformers  generate() on the training policy itself (any device; the fallback)
    vllm          a colocated vLLM engine on the same checkpoint: Marlin NVFP4, LoRA pushed from memory
    native        our engine on the policy's own weights: fused steps, per-sequence KV, CUDA-graph decode
    auto          on a CUDA device: native (faster than vllm on NVFP4 at batch 8 and 64, no second copy of the
                  weights: docs/benchmarks.md), or vllm / transformers where native cannot run the model (which
                  includes a BF16 base whose weights FSDP2 or ZeRO-3 shard); on CPU: transformers

The trainer builds its backend with `create_backend`; evaluation and the benchmarks build theirs the same way on a
model they hold (`RolloutSetup.for_model`, `build_backend`) or, for vLLM, on a checkpoint folder and a saved adapter
(`RolloutSetup.for_checkpoint`), and `with_auto_fallback` is auto's fallback for all of them. Each engine's settings
are a typed part of the setup (NativeSettings, TransformersSettings, VLLMSettings).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import GenerationConfig

from qerl.errors import UsageError
from qerl.field_rules import ROLLOUT_BACKENDS

logger = logging.getLogger(__name__)

Perturb = Callable[[nn.Module], AbstractContextManager]


@dataclass(frozen=True)
class NativeSettings:
    """The native engine's settings (qerl/rollout/native)."""

    kv_cache_gib: float | None = None  # KV-cache memory a round may take (None: 80% of what is free); waves past it
    kv_cache_dtype: str = "auto"  # field_rules.KV_CACHE_DTYPES
    compact_rows: bool = False  # decode only the live rows once at most half are (engine.py)


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


def _transformers() -> type[RolloutBackend]:
    from qerl.rollout.transformers import TransformersRollout

    return TransformersRollout


def _vllm() -> type[RolloutBackend]:
    from qerl.rollout.vllm import VLLMRollout

    return VLLMRollout


def _native() -> type[RolloutBackend]:
    from qerl.rollout.native import NativeRollout

    return NativeRollout


# name -> its class, imported on first use so that a CPU machine never imports vLLM (a new backend: one class, one
# function above, one line here). The names users choose from, these and auto, are listed again in
# field_rules.ROLLOUT_BACKENDS because --help and the flag checks read them without importing torch, which this
# package imports; tests/qerl/test_field_rules.py holds the two lists equal.
BACKENDS: dict[str, Callable[[], type[RolloutBackend]]] = {
    "transformers": _transformers,
    "vllm": _vllm,
    "native": _native,
}


def vllm_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


class Unsupported(UsageError):
    """A backend cannot run this model or set-up (auto then falls back to the next choice; a backend asked for by
    name stops the run in one line, see qerl.cli)."""


def serving_backend(device: torch.device | None = None) -> str:
    """vLLM on a CUDA device (`device`, when known) of a machine that has it, else transformers: the engines that
    load a checkpoint folder (evaluation, and auto's fallback)."""
    on_gpu = device is None or torch.device(device).type == "cuda"
    return "vllm" if on_gpu and vllm_available() else "transformers"


def resolve_backend(name: str, device: torch.device | None = None) -> str:
    """The backend `name` stands for first (see the module docstring for auto)."""
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"unknown rollout_backend {name!r}; available: {', '.join(ROLLOUT_BACKENDS)}")
    if name == "auto":
        on_gpu = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        return "native" if on_gpu else serving_backend(device)
    return name


T = TypeVar("T")


def with_auto_fallback(
    device: torch.device | str | None, use: Callable[[str], T], report: Callable[[Unsupported, str], None]
) -> T:
    """use(the backend auto stands for on `device`); where that raises Unsupported, report(the error, the serving
    backend) and use(the serving backend) instead. `use` builds a rollout backend (create_backend) or generates with
    one of evaluation's engines."""
    try:
        return use(resolve_backend("auto", device))
    except Unsupported as error:
        fallback = serving_backend(device)
        report(error, fallback)
        return use(fallback)


def build_backend(name: str, setup: RolloutSetup) -> RolloutBackend:
    """The backend registered as `name` (not auto), built on `setup`; Unsupported passes through as the engine
    worded it."""
    backend = BACKENDS[name]()
    if setup.open_policy is None and not backend.samples_from_checkpoint:
        raise Unsupported(f"the {name} backend samples from a policy in memory, and this setup has only a checkpoint")
    return backend(setup)


def create_backend(name: str, setup: RolloutSetup) -> RolloutBackend:
    """The backend `name` stands for, as the trainer builds it (auto: with its fallback, logged); one named but unable
    to run the model raises Unsupported saying what auto would use."""
    if name == "auto":
        report = functools.partial(logger.warning, "rollout_backend auto: %s; using %s")
        return with_auto_fallback(setup.device, lambda backend: build_backend(backend, setup), report)
    choice = resolve_backend(name, setup.device)
    try:
        return build_backend(choice, setup)
    except Unsupported as error:
        fallback = serving_backend(setup.device)
        raise Unsupported(f"rollout_backend {name}: {error}; rollout_backend auto would use {fallback}") from None
