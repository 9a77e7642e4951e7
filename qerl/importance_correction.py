"""TRL's importance-sampling correction (`vllm_importance_sampling_correction`), its ratio taken from the loss forward,
and the tap on that forward that the trainer's mismatch metrics read too.

TRL computes the ratio pi_train / pi_rollout of each sampled token from a separate forward over the whole round
(`old_per_token_logps`) before any micro-batch trains. When no optimizer step falls between sampling and training
(TRL's own test for skipping old log-probs: gradient_accumulation_steps a multiple of steps_per_generation x
num_iterations), the loss forward of each micro-batch runs those same parameters, so its log-probs, detached, are the
old ones: the trainer takes the ratio from them and saves the forward (a third of a step's compute on the 1.5B
recipe sampled one round ahead, docs/multi_gpu.md). The formulas and the sampling/* metric names are TRL 1.16's
(GRPOTrainer._generate_and_score_completions); tests/qerl/test_importance_correction.py holds them to TRL's own path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# vllm_importance_sampling_mode values, as TRL names them
TRUNCATE = ("token_truncate", "sequence_truncate")
MASK = ("token_mask", "sequence_mask")


def from_loss_forward(args) -> bool:
    """Whether the ratio can come from the loss forward: the correction is on, its factor is the loss's (VESPO
    takes the ratio inside its own formula), and the loss forward runs the parameters that sampled."""
    generate_every = args.steps_per_generation * args.num_iterations
    return (
        bool(args.vllm_importance_sampling_correction)
        and args.loss_type != "vespo"
        and args.gradient_accumulation_steps % generate_every == 0
    )


def correction_ratio(
    clean: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float | None, clip_max: float
) -> torch.Tensor:
    """The correction's factor on each token's loss, (B, T) for token modes and (B, 1) for sequence modes: exp of
    the clean minus the sampled log-probs (summed over the sequence in sequence modes), clamped (truncate) or zeroed
    outside [clip_min, clip_max] (mask). Tokens the sampler could not score (NaN) count as no difference."""
    diff = torch.nan_to_num((clean - sampling) * mask, nan=0.0)
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=-1, keepdim=True)
    factor = torch.exp(diff)
    if mode in TRUNCATE:
        return torch.clamp(factor, min=clip_min, max=clip_max)
    if mode in MASK:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return factor.masked_fill((factor < low) | (factor > high), 0.0)
    raise ValueError(f"vllm_importance_sampling_mode={mode!r}: one of {', '.join(TRUNCATE + MASK)}")


def mismatch_stats(
    clean: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, factor: torch.Tensor | None = None
) -> dict[str, tuple[torch.Tensor, str]]:
    """TRL's sampling/* metrics of one batch, each with how ranks combine it (min, mean or max): the |difference|
    of the clean and sampled log-probs over the scored tokens, and the ratio (the correction's `factor` where it
    applies one, else the plain exp of the difference)."""
    mask = mask.bool()
    diff = clean - sampling
    scored = mask & ~torch.isnan(diff)
    delta = diff[scored].abs()
    if factor is None:
        flat = torch.exp(diff[scored])
    else:
        flat = factor.flatten() if factor.size(-1) == 1 else factor[mask]
    zero = torch.tensor(0.0, device=clean.device)

    def pick(values: torch.Tensor, how: str) -> torch.Tensor:
        return getattr(values, how)() if values.numel() else zero

    return {
        "sampling/sampling_logp_difference/mean": (pick(delta, "mean"), "mean"),
        "sampling/sampling_logp_difference/max": (pick(delta, "max"), "max"),
        "sampling/importance_sampling_ratio/min": (pick(flat, "min"), "min"),
        "sampling/importance_sampling_ratio/mean": (pick(flat, "mean"), "mean"),
        "sampling/importance_sampling_ratio/max": (pick(flat, "max"), "max"),
    }


def scored(batch) -> torch.Tensor:
    """The tokens a batch's loss scores: its completions' minus any tool output."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


@dataclass
class LossForwardTap:
    """What the trainer needs of TRL's loss forward that TRL's _compute_loss does not return: the log-probs of each
    forward it runs (`logps`, detached) and, where the correction's ratio comes from that forward, the ratio written
    into the loss's inputs (`ratio_into`), which TRL reads after the forward. Open only while the trainer's
    _compute_loss runs TRL's; its _get_per_token_logps_and_entropies hands each forward's log-probs to `take`."""

    ratio_into: dict | None
    mode: str  # the ratio's vllm_importance_sampling_mode, clip_min and clip_max
    clip_min: float | None
    clip_max: float | None
    logps: list[torch.Tensor] = field(default_factory=list)

    def take(self, logps: torch.Tensor) -> None:
        self.logps.append(logps.detach())
        if self.ratio_into is not None and len(self.logps) == 1:  # the loss forward: the first TRL's loss runs
            batch = self.ratio_into
            batch["importance_sampling_ratio"] = correction_ratio(
                self.logps[0], batch["sampling_per_token_logps"], scored(batch), self.mode, self.clip_min, self.clip_max
            )
