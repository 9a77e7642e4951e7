"""What each part of the native engine's CUDA-graph decode step costs, measured inside the graph.

    python -m benchmarks.probes.step_costs --size 7b --batches 2,8 [--new-tokens 512]

The decode step is timed whole, then with one kernel family at a time replaced by a stand-in that only allocates
its output (same shapes, wrong values: the tokens sampled under a stand-in are meaningless, the times are not), all on
one model and engine. The difference to the whole step is what that family costs in the graph, launch gaps and
programmatic-dependent-launch overlap included, which the eager profile of `benchmarks.rollout --profile` cannot
show (there, kernels launched early count the time they wait for their predecessor). The last row leaves every
stand-in in at once: what remains is the NVFP4 GEMMs without their LoRA, the LM head and the step's bookkeeping.

Random-weight Qwen2.5 shapes, NVFP4, LoRA r16 on every projection, prompts of --prompt-len tokens, no EOS; each
figure is the best of two timed rollouts after a warm-up, and the whole step is timed first and last to show drift.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the engine load after the flags are read
    from qerl.rollout.native.engine import NativeEngine


@contextlib.contextmanager
def _replaced(owner, name: str, value) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _replaced_in(module: str, name: str, value) -> contextlib.AbstractContextManager:
    """_replaced on a module of the native engine (loaded by the time a stand-in goes in)."""
    return _replaced(importlib.import_module(f"qerl.rollout.native.{module}"), name, value)


def _skip_norm(x, weight, eps, residual=None, unit_offset=False):
    return x


def _skip_silu_mul(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def _skip_rope_cache(qkv, cos, sin, batch_idx, positions, k, v, num_heads, num_kv_heads, k_scale, v_scale):
    return qkv.new_empty(qkv.shape[0], num_heads, k.shape[-1])


def _skip_attention(q, k_cache, v_cache, seq_lens, scale, **kwargs):
    return q


def _argmax_sampler(logits):
    return logits.argmax(-1), logits[:, 0]


@contextlib.contextmanager
def _without_lora(engine: NativeEngine) -> Iterator[None]:
    projections = list(engine.decoder.projections())
    saved = [(p.lora_a, p.lora_b) for p in projections]
    for p in projections:
        p.lora_a = p.lora_b = None
    try:
        yield
    finally:
        for p, (a, b) in zip(projections, saved, strict=True):
            p.lora_a, p.lora_b = a, b


# family -> (engine -> context manager in which the family's kernels are replaced by their stand-in)
STAND_INS: dict[str, Callable[[NativeEngine], contextlib.AbstractContextManager]] = {
    "add+RMSNorm": lambda engine: _replaced_in("elementwise", "rmsnorm", _skip_norm),
    "SiLU gate": lambda engine: _replaced_in("elementwise", "silu_mul", _skip_silu_mul),
    "rotary+KV write": lambda engine: _replaced_in("elementwise", "rope_cache", _skip_rope_cache),
    "attention": lambda engine: _replaced_in("engine", "decode_attention", _skip_attention),
    "sampling (all but an argmax)": lambda engine: _replaced(engine, "sampler", _argmax_sampler),
    "LoRA (in the NVFP4 GEMMs)": _without_lora,
}


@contextlib.contextmanager
def without(engine: NativeEngine, families) -> Iterator[None]:
    """The engine with the named families' kernels replaced by their stand-ins (restored on exit)."""
    with contextlib.ExitStack() as stack:
        for family in families:
            stack.enter_context(STAND_INS[family](engine))
        yield


def step_ms(engine: NativeEngine, prompts: list[list[int]], new_tokens: int, repeats: int = 2) -> float:
    """Best-of-`repeats` milliseconds per decode step of one rollout (after a short warm-up at the same batch)."""
    import torch

    engine.generate(prompts, 16)
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        ids, _ = engine.generate(prompts, new_tokens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / max(len(row) for row in ids))
    return 1e3 * best


def step_costs(engine: NativeEngine, prompts: list[list[int]], new_tokens: int, repeats: int = 2) -> list[dict]:
    """Rows (what was replaced, ms per step): the whole step first and last, each family alone, all at once."""
    configs = [(), *[(family,) for family in STAND_INS], tuple(STAND_INS), ()]
    rows = []
    for families in configs:
        with without(engine, families):
            ms = step_ms(engine, prompts, new_tokens, repeats)
        rows.append({"replaced": list(families), "ms_per_step": ms})
    return rows


def main(argv=None) -> None:
    from benchmarks import random_models, rollout

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=random_models.SIZES, default="7b")
    parser.add_argument("--batches", default="2,8")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", default="runs/step_costs.json")
    args = parser.parse_args(argv)
    import torch

    from qerl.rollout import create_backend

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.probes.step_costs needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",") if b]
    model = random_models.with_lora(random_models.build(args.size, "nvfp4"), args.lora_rank)
    engine = create_backend("native", rollout.setup_for(model, args.new_tokens, None, {})).engine
    engine.decoder.refresh()  # the adapter into the engine's buffers, as every round does
    gen = torch.Generator().manual_seed(1)
    results = {}
    for batch in batches:
        prompts = torch.randint(10, model.config.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        results[batch] = step_costs(engine, prompts, args.new_tokens)

    print(
        f"\n{args.size} shapes, NVFP4, LoRA r{args.lora_rank}, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, {torch.cuda.get_device_name()}: ms per decode step, and what the replaced part cost"
    )
    for batch, rows in results.items():
        whole = min(rows[0]["ms_per_step"], rows[-1]["ms_per_step"])
        print(f"batch {batch}: whole step {rows[0]['ms_per_step']:.3f} (first) / {rows[-1]['ms_per_step']:.3f} (last)")
        for row in rows[1:-1]:
            name = "all of the above" if len(row["replaced"]) > 1 else row["replaced"][0]
            cost = whole - row["ms_per_step"]
            share = 100 * cost / whole
            print(f"    without {name:32s} {row['ms_per_step']:7.3f} ms   cost {cost:6.3f} ms ({share:4.1f}%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": results}, indent=2)
    )


if __name__ == "__main__":
    main()
