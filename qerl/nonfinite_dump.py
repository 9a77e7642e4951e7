"""dump_nonfinite_grads (QeRLConfig): after each micro-batch's backward, the trainable gradients are checked for NaN
and Inf; the first micro-batch that makes one non-finite is saved, with the trainable parameters it ran with, to
<output_dir>/nonfinite-step<N>-micro<M>.pt, which `python -m experiments.nonfinite` replays.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)


def loss_settings(args, temperature: float, loss_type: str) -> dict:
    """What a replay needs to rebuild a run's loss besides the batch: TRL's temperature and loss type, and the LoRA
    of `args` (a QeRLConfig)."""
    return {
        "temperature": temperature,
        "loss_type": loss_type,
        "lora": {
            "rank": args.lora_rank,
            "alpha": args.lora_alpha,
            "targets": list(args.lora_target_modules),
            "trainable_norms": args.trainable_norms,
        },
    }


def nonfinite_grads(model: nn.Module) -> list[str]:
    """The names of the parameters whose gradient holds a NaN or an Inf."""
    return [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]


@torch.no_grad()
def dump_if_nonfinite(
    policy: nn.Module, output_dir: str, step: int, micro: int, batch: dict | None, loss_settings: dict
) -> str | None:
    """The dump's path if a trainable gradient of `policy` is non-finite (None otherwise): `batch`, the micro-batch
    as the loss saw it, and `loss_settings`, what the replay needs to rebuild that loss (temperature, loss_type,
    lora). Gradients accumulate over the micro-batches of a step, so the first check that fails names the
    micro-batch that made them non-finite; the parameters are still those it ran with (the optimizer steps after the
    last)."""
    bad = nonfinite_grads(policy)  # only trainable parameters have gradients
    if not bad:
        return None
    path = os.path.join(output_dir, f"nonfinite-step{step}-micro{micro}.pt")
    batch = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in (batch or {}).items()}
    torch.save(
        {
            "step": step,
            "micro_batch": micro,
            "nonfinite_grads": bad,
            "batch": batch,
            "trainable": {n: p.detach().cpu() for n, p in policy.named_parameters() if p.requires_grad},
            **loss_settings,
        },
        path,
    )
    logger.error(
        "step %d, micro-batch %d made %d trainable gradients non-finite (first: %s); saved to %s",
        step,
        micro,
        len(bad),
        bad[0],
        path,
    )
    return path
