"""What the kernels ask of the device they run on: whether Triton's CPU interpreter is on, whether the Triton kernels
take a tensor, a GPU's compute capability (which kernels and launch features it has) and how many streaming
multiprocessors it has (what split-K and grid sizes are fitted to); and how much memory a new allocation can take, with
the rule the dense training weights, the kept rollout cache and the kept activations each take it by (MemoryRule).

Imports nothing of qerl, so that every layer (nvfp4, the rollout engine, benchmarks) can read it.
"""

from __future__ import annotations

import functools
import logging
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


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can take on `device`: on CUDA the free memory plus what torch's caching allocator
    reserved and does not use (the engine's freed KV cache sits there after a round); on the CPU the free RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (not POSIX): do not guess
        return 0


class MemoryRule:
    """A default taken while what it holds takes at most `share` of the memory available (the dense training weights,
    the kept rollout cache, the kept activations), saying in one line each time the decision changes."""

    def __init__(self, logger: logging.Logger, what: str, share: float, flag: str, taken: str, left: str):
        self.logger, self.what, self.share, self.flag, self.taken, self.left = logger, what, share, flag, taken, left
        self._last: bool | None = None

    def __call__(self, needed: int, available: int) -> bool:
        take = needed <= self.share * available
        if take != self._last:
            self.logger.info(
                "%s %s: %.2f GiB of %.1f GiB available (taken up to %d%%; %s true/false decides)",
                self.what,
                self.taken if take else self.left,
                needed / 2**30,
                available / 2**30,
                round(self.share * 100),
                self.flag,
            )
            self._last = take
        return take
