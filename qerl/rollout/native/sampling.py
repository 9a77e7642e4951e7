"""Sampling on the GPU, inside the decode step's CUDA graph: the trainer's sampling settings, and the log-prob of
each sampled token under the distribution it was drawn from.

The filters are transformers' own warpers (temperature, top-k, top-p, min-p: `rollout.warpers`, shared with
the transformers backend), which run on fixed shapes and so capture in a graph. The draw is the exponential
race, argmax(p / E) with E ~ Exp(1) i.i.d., which picks token i with probability p_i without the host syncs
and data-dependent shapes of torch.multinomial; the RNG is the CUDA default generator, which graphs capture.

With temperature alone (the recipes' setting) the same race runs in two Triton kernels instead of half a dozen torch
ones (log-softmax, the exponentials, exp, divide, argmax, gather: each a launch, the row-wise ones on a few programs
per row): programs over chunks of the vocabulary find their chunk's maximum, sum of exponentials and race winner
(argmax of logit / T - log E, E = -log U from Philox), and one program per row merges them into the token and its
log-prob. The Philox seed is drawn from the CUDA default generator on every call, so runs stay reproducible under
torch.manual_seed and every graph replay draws afresh.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, TemperatureLogitsWarper

from qerl.device_facts import triton_runs_on
from qerl.rollout.warpers import sampling_warpers

try:  # Triton is Linux-only; the torch path serves everywhere else.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the platform
    triton = None

VOCAB_CHUNK = 4096  # vocabulary entries per program of the first kernel: 38 programs per row at Qwen2.5's 152k


def _temperature_alone(warpers) -> float | None:
    """The temperature when it is the only filter (1.0 when there is none): what the fused kernels apply."""
    if not warpers:
        return 1.0
    if len(warpers) == 1 and isinstance(warpers[0], TemperatureLogitsWarper):
        return warpers[0].temperature
    return None


class Sampler:
    def __init__(self, generation_config: GenerationConfig, vocab_chunk: int = VOCAB_CHUNK):
        self.greedy = not generation_config.do_sample
        self.warpers = sampling_warpers(generation_config)
        self.temperature = _temperature_alone(self.warpers)
        self.vocab_chunk = vocab_chunk

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [B], their log-probs [B]) for FP32 logits [B, V]."""
        if not self.greedy and self.temperature is not None and triton_runs_on(logits):
            return sample_fused(logits, self.temperature, self.vocab_chunk)
        logprobs = torch.log_softmax(self.warpers(None, logits), dim=-1)
        if self.greedy:
            tokens = logprobs.argmax(dim=-1)
        else:
            race = torch.empty_like(logprobs).exponential_()
            tokens = (logprobs.exp() / race).argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


if triton is not None:

    @triton.jit
    def _race_chunk_kernel(
        logits_ptr,
        seed_ptr,
        max_ptr,
        sum_ptr,
        win_val_ptr,
        win_idx_ptr,
        vocab,
        stride_b,
        temperature,
        CHUNKS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One chunk of one row: max of x = logit / T, sum of exp(x - max), and the race winner argmax(x - log E)."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < vocab
        x = tl.load(logits_ptr + row * stride_b + cols, mask=ok, other=float("-inf")) / temperature
        m = tl.max(x, 0)
        s = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
        u = tl.rand(tl.load(seed_ptr), row * vocab + cols)  # uniform [0, 1); E = -log(u) ~ Exp(1)
        race = tl.where(ok, x - tl.log(-tl.log(u)), float("-inf"))
        best = tl.max(race, 0)
        idx = tl.min(tl.where(race == best, cols, vocab), 0)  # the first winner (ties have probability zero)
        out = row * CHUNKS + chunk
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, s)
        tl.store(win_val_ptr + out, best)
        tl.store(win_idx_ptr + out, idx)

    @triton.jit
    def _race_merge_kernel(
        logits_ptr,
        max_ptr,
        sum_ptr,
        win_val_ptr,
        win_idx_ptr,
        token_ptr,
        logprob_ptr,
        stride_b,
        temperature,
        CHUNKS: tl.constexpr,
        BLOCK_CHUNKS: tl.constexpr,
    ):
        """One row: the chunks' log-sum-exp, the winning token and its log-prob x[token] - lse."""
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_CHUNKS)
        ok = c < CHUNKS
        m = tl.load(max_ptr + row * CHUNKS + c, mask=ok, other=float("-inf"))
        s = tl.load(sum_ptr + row * CHUNKS + c, mask=ok, other=0.0)
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(tl.where(ok, s * tl.exp(m - top), 0.0), 0))
        val = tl.load(win_val_ptr + row * CHUNKS + c, mask=ok, other=float("-inf"))
        idx = tl.load(win_idx_ptr + row * CHUNKS + c, mask=ok, other=0)
        best = tl.max(val, 0)
        token = tl.min(tl.where(val == best, idx, 2**31 - 1), 0)
        x = tl.load(logits_ptr + row * stride_b + token) / temperature
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logprob_ptr + row, x - lse)


def sample_fused(
    logits: torch.Tensor, temperature: float, vocab_chunk: int = VOCAB_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exponential race at `temperature` over FP32 logits [B, V] (last dim contiguous, B x V < 2^31: the Philox
    offsets) in two kernels: (token ids int64 [B], log_softmax(logits / temperature) at those tokens [B])."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be FP32 [B, V] with a contiguous last dim; got {logits.dtype} "
            f"{tuple(logits.shape)} strides {logits.stride()}"
        )
    if vocab_chunk < 16 or vocab_chunk & (vocab_chunk - 1):
        raise ValueError(f"vocab_chunk must be a power of two >= 16; got {vocab_chunk}")
    b, vocab = logits.shape
    chunks = triton.cdiv(vocab, vocab_chunk)
    seed = torch.randint(0, 2**31 - 1, (1,), device=logits.device, dtype=torch.int64)  # advances per graph replay
    partial = torch.empty((3, b, chunks), dtype=torch.float32, device=logits.device)  # max, sum, race winner
    win_idx = torch.empty((b, chunks), dtype=torch.int32, device=logits.device)
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    _race_chunk_kernel[(b, chunks)](
        logits,
        seed,
        partial[0],
        partial[1],
        partial[2],
        win_idx,
        vocab,
        logits.stride(0),
        temperature,
        CHUNKS=chunks,
        BLOCK=vocab_chunk,
        num_warps=8 if vocab_chunk >= 2048 else 4,
    )
    _race_merge_kernel[(b,)](
        logits,
        partial[0],
        partial[1],
        partial[2],
        win_idx,
        tokens,
        logprobs,
        logits.stride(0),
        temperature,
        CHUNKS=chunks,
        BLOCK_CHUNKS=max(16, triton.next_power_of_2(chunks)),
        num_warps=1,
    )
    return tokens, logprobs
