"""The generation batch's micro-batches grouped by length, so that the training passes run on little padding.

TRL shuffles each generation batch (rollouts of `steps_per_generation` micro-batches) and splits it into equal
micro-batches. The unpadded forward (qerl/unpadded_forward.py) cuts each micro-batch at its longest row, and with a
random split nearly every micro-batch holds one of the long rows: on the 1.5B recipe (completions averaging ~200
tokens, the longest 440-512) most of each training pass goes to padding after the short rows. Sorting the rows by
length before the split puts long rows with long rows, and each micro-batch is cut near its own rows' lengths.

The split changes nothing else where the accumulated gradient is a sum over the micro-batches that does not depend on
which row went where (`split_free`): losses normalized by the whole generation batch or per sequence, equal
micro-batches, one optimizer step per generation batch, no per-micro-batch statistic in the loss. There the rows
only move between micro-batches; elsewhere TRL's random split stays.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import split_tensor_dict

# Loss types whose micro-batch losses add up to the generation batch's whatever the split (TRL's compute_loss):
# normalized by the generation batch's tokens (dapo, cispo), by a constant (dr_grpo), or a mean over equal-sized
# micro-batches of per-sequence terms (grpo, sapo, luspo). bnpo divides by each micro-batch's own token count.
SPLIT_FREE_LOSSES = ("dapo", "cispo", "dr_grpo", "grpo", "sapo", "luspo")


def split_free(args, entropy_bonus: bool) -> str | None:
    """None where the accumulated gradient does not depend on how the generation batch is split into micro-batches;
    else why it does (one line). `entropy_bonus`: the trainer adds TRL's entropy bonus (static or adaptive)."""
    if args.loss_type not in SPLIT_FREE_LOSSES:
        return f"loss_type {args.loss_type} normalizes each micro-batch by its own tokens"
    if args.top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 takes its entropy quantile per micro-batch"
    if entropy_bonus:
        return "the entropy bonus is a mean per micro-batch"
    if args.steps_per_generation != args.gradient_accumulation_steps:
        return "steps_per_generation is not gradient_accumulation_steps: the split decides which step sees which rows"
    if not args.unpadded_forward:
        return "without the unpadded forward every micro-batch keeps the generation batch's widths"
    return None


def real_lengths(batch: dict) -> torch.Tensor:
    """Each row's real tokens: its prompt, then its completion up to EOS (what the unpadded forward runs)."""
    return batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)


def by_length(micro_batches: list[dict]) -> list[dict]:
    """The same rows in as many equal micro-batches, sorted by real length (shortest first). Per-row values (tensors
    with a batch dimension, lists) move with their rows; scalars (num_items_in_batch) stay as they are."""
    rows = {key: _joined([mb[key] for mb in micro_batches]) for key in micro_batches[0]}
    order = torch.argsort(real_lengths(rows).cpu(), stable=True)
    for key, value in rows.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            rows[key] = value[order.to(value.device)]
        elif isinstance(value, list):
            rows[key] = [value[i] for i in order.tolist()]
    return split_tensor_dict(rows, len(micro_batches))


def _joined(values: list):
    first = values[0]
    if isinstance(first, torch.Tensor) and first.ndim > 0:
        return torch.cat(values)
    if isinstance(first, list):
        return [item for value in values for item in value]
    return first  # a scalar or None, the same in every micro-batch
