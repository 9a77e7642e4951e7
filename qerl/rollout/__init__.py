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
    server        rollout servers on GPUs of their own (python -m qerl.rollout_server): the adapter sent as it
                  changes, AQN as its seed (server_backend.py)
    auto          on a CUDA device: native (faster than vllm on NVFP4 at batch 8 and 64, no second copy of the
                  weights: docs/benchmarks.md), or vllm / transformers where native cannot run the model (which
                  includes a BF16 base whose weights FSDP2 or ZeRO-3 shard); on CPU: transformers

The trainer builds its backend with `create_backend`; evaluation and the benchmarks build theirs the same way on a
model they hold (`RolloutSetup.for_model`, `build_backend`) or, for vLLM, on a checkpoint folder and a saved adapter
(`RolloutSetup.for_checkpoint`), and `with_auto_fallback` is auto's fallback for all of them. Each engine's settings
are a typed part of the setup (NativeSettings, TransformersSettings, VLLMSettings).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from qerl.field_rules import ROLLOUT_BACKENDS
from qerl.rollout.base import (
    NativeSettings,
    Perturb,
    RolloutBackend,
    RolloutOutput,
    RolloutSetup,
    ServerSettings,
    TransformersSettings,
    Unsupported,
    VLLMSettings,
    no_noise,
    truncate_at_eos,
)

__all__ = [
    "BACKENDS",
    "NativeSettings",
    "Perturb",
    "RolloutBackend",
    "RolloutOutput",
    "RolloutSetup",
    "ServerSettings",
    "TransformersSettings",
    "Unsupported",
    "VLLMSettings",
    "build_backend",
    "create_backend",
    "no_noise",
    "resolve_backend",
    "serving_backend",
    "truncate_at_eos",
    "vllm_available",
    "with_auto_fallback",
]

logger = logging.getLogger(__name__)


def _transformers() -> type[RolloutBackend]:
    from qerl.rollout.transformers import TransformersRollout

    return TransformersRollout


def _vllm() -> type[RolloutBackend]:
    from qerl.rollout.vllm import VLLMRollout

    return VLLMRollout


def _server() -> type[RolloutBackend]:
    from qerl.rollout.server_backend import ServerRollout

    return ServerRollout


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
    "server": _server,
}


def vllm_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


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
