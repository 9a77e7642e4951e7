"""What the kernels ask of the device they run on: whether Triton's CPU interpreter is on, whether the Triton kernels
take a tensor, a GPU's compute capability (which kernels and launch features it has) and how many streaming
multiprocessors it has (what split-K and grid sizes are fitted to).

Imports nothing of qerl, so that every layer (nvfp4, the rollout engine, benchmarks) can read it.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton is Linux-only; without it no Triton kernel runs anywhere.
    import triton
except ImportError:  # pragma: no cover - depends on the platform
    triton = None

# Read once at import, as Triton itself reads it: kernels select portable variants by this constexpr.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether the Triton kernels take tensors on t's device: CUDA, or the CPU under TRITON_INTERPRET=1."""
    return triton is not None and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


@functools.cache  # asked on every eager launch: torch's query costs microseconds of host time
def compute_capability(index: int) -> tuple[int, int]:
    """(major, minor) of the CUDA device `index`."""
    return torch.cuda.get_device_capability(index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors; 4 off CUDA (the interpreter: a small machine, so that the CPU tests
    see several splits)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
