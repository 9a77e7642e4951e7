"""Sampling on the GPU, inside the decode step's CUDA graph: the trainer's sampling settings, and the log-prob of
each sampled token under the distribution it was drawn from.

The filters are transformers' own warpers (temperature, top-k, top-p, min-p: `sampling_warpers`, shared with
the transformers backend), which run on fixed shapes and so capture in a graph. The draw is the exponential
race, argmax(p / E) with E ~ Exp(1) i.i.d., which picks token i with probability p_i without the host syncs
and data-dependent shapes of torch.multinomial; the RNG is the CUDA default generator, which graphs capture.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from qerl.rollout.transformers import sampling_warpers


class Sampler:
    def __init__(self, generation_config: GenerationConfig):
        self.greedy = not generation_config.do_sample
        self.warpers = sampling_warpers(generation_config)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [B], their log-probs [B]) for FP32 logits [B, V]."""
        logprobs = torch.log_softmax(self.warpers(None, logits), dim=-1)
        if self.greedy:
            tokens = logprobs.argmax(dim=-1)
        else:
            race = torch.empty_like(logprobs).exponential_()
            tokens = (logprobs.exp() / race).argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
