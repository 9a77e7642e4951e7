"""Programmatic dependent launch (PDL, Hopper and newer) for the Triton kernels of a decode step.

A kernel launched with `launch_pdl=True` may be scheduled while the kernel before it in the stream is still
running; it blocks in `griddepcontrol.wait` until that kernel has finished and its writes are visible. In a
CUDA-graph decode step of a few hundred short kernels this hides the launch gap between neighbours, which is
otherwise paid once per kernel (measured: docs/benchmarks.md, section "S4": 0.13 ms of a 7B batch-8 step).

The contract every kernel launched with `launch_pdl=pdl_enabled(device)` keeps:
  * `wait_for_previous_kernel(PDL)` before it writes any tensor another kernel touches, and before it reads any
    that the kernel launched just before it writes. Every such kernel waits, so the chain stays ordered: a kernel
    that skipped the wait could finish before its predecessor, and the next kernel, which waits only on its
    immediate predecessor, would read too early.
  * What the previous kernel does not write may be read before the wait (weights, norm scales, rotary tables,
    the positions and lengths set at the start of a decode step): every kernel here waits before it lets the next
    one launch, so the kernel before the previous one has finished by then. Those loads then overlap the previous
    kernel's tail instead of following the wait (the RMSNorm scale: 3% of the 7B decode step, docs/benchmarks.md).
  * `let_next_kernel_launch(PDL)` where the rest of its work no longer needs free SM slots (a hint: the next
    kernel's programs then get scheduled and wait at their own `wait_for_previous_kernel`).
Kernels of other libraries (cuBLAS) between ours launch without PDL and wait for their predecessor as usual.
"""

from __future__ import annotations

import os

import torch

from qerl.device_facts import INTERPRET, compute_capability

try:  # Triton is Linux-only; without it nothing here is launched.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the platform
    triton = None


def pdl_enabled(device: torch.device) -> bool:
    """Launch with PDL: a CUDA device of compute capability 9.0+, not the interpreter, QERL_PDL not "0"."""
    if triton is None or INTERPRET or device.type != "cuda" or os.environ.get("QERL_PDL", "1") == "0":
        return False
    return compute_capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


if triton is not None:

    @triton.jit
    def wait_for_previous_kernel(PDL: tl.constexpr):
        if PDL:
            gdc_wait()

    @triton.jit
    def let_next_kernel_launch(PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
