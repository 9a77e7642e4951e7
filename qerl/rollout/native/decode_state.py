"""What the native engine's decode step reads and advances (DecodeState: fixed addresses, so that a captured CUDA
graph replays on them), and what NativeEngine.keep_between_rounds keeps from one round to the next (KeptWave: the KV
cache and a KeptStep per batch size the round decoded at)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from qerl.rollout.native import kv_cache
from qerl.rollout.native.decoder import Decoder


@dataclass(eq=False)
class KeptStep:
    """A decode step of one batch size and the state it reads and advances (fixed addresses across replays)."""

    state: DecodeState
    run: Callable[[], None]  # the captured step's replay (the eager step without CUDA graphs)


@dataclass(eq=False)
class KeptWave:
    """A one-wave round's KV cache and captured decode steps (NativeEngine.keep_between_rounds), for the next round
    of as many sequences and new tokens: the graphs replay on the same tensors, so they stay. `steps` by batch size:
    the wave's, and each smaller one live-row compaction reached (its rows are a view at the front of the same
    cache, and a later round that compacts to that size copies its live rows into that step's state)."""

    cache: kv_cache.KVCache
    pool: object  # the graphs' memory pool
    max_new_tokens: int
    rope: list[torch.Tensor]  # the rotary tables the graphs read: longer ones replace them (ensure_positions)
    steps: dict[int, KeptStep] = field(default_factory=dict)

    @property
    def state(self) -> DecodeState:
        """The whole wave's decode state."""
        return self.steps[max(self.steps)].state

    def fits(self, batch: int, capacity: int, max_new_tokens: int, decoder: Decoder, kv_fp8: bool) -> bool:
        """Whether a wave of this shape can replay it. A cache over twice what the wave needs is not kept on: one
        long round would otherwise hold the largest cache, and spread the attention over more splits, for good.
        (New rotary tables hold the old ones' values too, but the graph reads the old tensors: captured again.)"""
        return (
            len(self.state.tokens) == batch
            and capacity <= self.cache.capacity < 2 * capacity
            and max_new_tokens == self.max_new_tokens
            and self.cache.fp8 == kv_fp8
            and decoder.cos is self.rope
        )


class DecodeState:
    """The tensors a captured decode step reads and advances (fixed addresses across replays)."""

    ROW_TENSORS = ("tokens", "positions", "seq_lens", "done", "out_ids", "out_logprobs")  # a row per sequence

    def __init__(
        self,
        first: torch.Tensor,
        first_logprob: torch.Tensor,
        lengths: torch.Tensor,
        max_new_tokens: int,
        pad_token_id: int,
    ):
        batch, device = first.shape[0], first.device
        self.pad_token_id = pad_token_id
        self.tokens = torch.empty_like(first)  # the token each sequence feeds next
        self.positions = torch.empty_like(lengths)  # ... and its position
        self.seq_lens = torch.empty_like(lengths)  # keys valid during the step
        self.batch_idx = torch.arange(batch, dtype=torch.int32, device=device)
        self.done = torch.empty(batch, dtype=torch.bool, device=device)
        self.out_ids = torch.empty((batch, max_new_tokens), dtype=torch.long, device=device)
        self.out_logprobs = torch.empty((batch, max_new_tokens), dtype=torch.float32, device=device)
        self.step = torch.empty(1, dtype=torch.long, device=device)
        self.reset(first, first_logprob, lengths)

    def reset(self, first: torch.Tensor, first_logprob: torch.Tensor, lengths: torch.Tensor) -> None:
        """A round's start, written into the state's tensors (a kept graph replays on their addresses)."""
        self.tokens.copy_(first)
        self.positions.copy_(lengths)
        torch.add(lengths, 1, out=self.seq_lens)
        self.done.zero_()
        self.out_ids.fill_(self.pad_token_id)
        self.out_logprobs.zero_()
        self.out_ids[:, 0] = first
        self.out_logprobs[:, 0] = first_logprob
        self.step.fill_(1)

    def snapshot(self):
        return [t.clone() for t in (self.tokens, self.positions, self.done, self.step)]

    def restore(self, saved) -> None:
        for t, s in zip((self.tokens, self.positions, self.done, self.step), saved, strict=True):
            t.copy_(s)

    def take_rows(self, source: DecodeState, rows: torch.Tensor) -> DecodeState:
        """`source`'s rows `rows` written into this state's tensors (as keep_rows gives them, at fixed addresses);
        returns self."""
        for name in self.ROW_TENSORS:
            torch.index_select(getattr(source, name), 0, rows, out=getattr(self, name))
        self.step.copy_(source.step)
        return self

    def keep_rows(self, rows: torch.Tensor) -> DecodeState:
        """The state of rows `rows` only (new tensors, numbered 0..len(rows)-1 in the cache: kv_cache.keep_rows)."""
        kept = object.__new__(DecodeState)
        for name in self.ROW_TENSORS:
            setattr(kept, name, getattr(self, name)[rows])
        kept.batch_idx = torch.arange(len(rows), dtype=torch.int32, device=rows.device)
        kept.step = self.step.clone()
        kept.pad_token_id = self.pad_token_id
        return kept
