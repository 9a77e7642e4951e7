"""What makes a timed figure honest, shared by the benchmarks: repeats summarised by their median and spread, and the
Triton kernels compiled while a timed call ran (a compilation inside a timed call times the compiler, not the code).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Compilations:
    """The names of the Triton kernels compiled inside the block; `known` is False where this Triton has no compile
    hook (then nothing can be said)."""

    names: list[str] = field(default_factory=list)
    known: bool = False


@contextlib.contextmanager
def compilations() -> Iterator[Compilations]:
    """Counts Triton JIT compilations inside the block through triton.knobs.runtime.jit_post_compile_hook (Triton
    >= 3.4), chained after any hook already there and put back after."""
    found = Compilations()
    try:
        from triton import knobs

        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield found
        return

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        found.names.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[")[0])
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    found.known = True
    try:
        yield found
    finally:
        runtime.jit_post_compile_hook = previous


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
