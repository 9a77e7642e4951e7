"""benchmarks/timing.py: the Triton compilations inside a timed block are counted through Triton's own compile hook
(chained after a hook already there, which is put back), and repeats are summarised by median and spread."""

import pytest

from benchmarks.timing import compilations, spread


def test_compilations_inside_the_block_are_named_and_the_hook_restored():
    knobs = pytest.importorskip("triton.knobs")
    runtime = knobs.runtime
    seen_by_previous = []

    def previous(**kwargs):
        seen_by_previous.append(kwargs["repr"])

    class Info:  # what Triton hands the hook as fn (module, name, the JIT function)
        name = "_split_kernel"

    original, runtime.jit_post_compile_hook = runtime.jit_post_compile_hook, previous
    try:
        with compilations() as compiled:
            assert compiled.names == [] and compiled.known
            runtime.jit_post_compile_hook(key="k", repr="_split_kernel[num_warps=4](...)", fn=Info(), compile={},
                                          is_manual_warmup=False, already_compiled=False)  # fmt: skip
            runtime.jit_post_compile_hook(key="k2", repr="_merge_kernel[num_warps=4](...)", fn=None, compile={},
                                          is_manual_warmup=False, already_compiled=False)  # fmt: skip
        assert compiled.names == ["_split_kernel", "_merge_kernel"]
        assert len(seen_by_previous) == 2  # the hook that was there still saw both
        assert runtime.jit_post_compile_hook is previous
    finally:
        runtime.jit_post_compile_hook = original


def test_spread():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}
