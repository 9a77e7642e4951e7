"""TRL's padded batch as rows that start at column 0: what the training forwards run instead of its padding.

TRL lays a batch out as [left-padded prompt | right-padded completion] at the widths of the longest prompt and the
longest completion of the whole generation batch, and masks the padding inside attention. That costs compute on
every pad column, and the padding mask keeps PyTorch's SDPA off FlashAttention (EFFICIENT_ATTENTION takes the mask;
cuDNN, which also would, is excluded: trainer.TRAINING_SDPA_BACKENDS).

Here each row's real tokens (attention mask 1: its prompt, then its completion up to EOS) move to the front, the
batch is cut at its longest row, and rows without a completion token to score (a DAPO-masked truncation) are left
out. Padding then sits only after each row's last token, where a causal mask already keeps every real token from
seeing it: the forward needs no padding mask, and its log-probs are those of TRL's layout in exact arithmetic.
(Positions start at 0 in every row instead of after the left padding; rotary attention depends on position
differences only. The native engine's prefill numbers positions the same way.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

IGNORE = -100  # the label of a position that is not scored, as transformers and TRL's fused LM head read it
# Under compiled layers (compile_layers, dynamic shapes) a shape torch.compile specialized on compiles anew: a batch of
# one row (a size of 1 is always specialized), and a width that breaks the alignment to 8 that inductor guarded on
# when the first width was a multiple of 8 (seen on the H200: a recompile at the third step). Such batches are given
# a second row that scores nothing and their width padded up to a multiple of 8.
COMPILED_MIN_ROWS = 2
COMPILED_WIDTH_MULTIPLE = 8


@dataclass
class UnpaddedBatch:
    input_ids: torch.Tensor  # [kept rows, width]: each row's real tokens from column 0, then padding
    labels: torch.Tensor  # [kept rows, width]: the completion tokens where they sit, IGNORE elsewhere
    rows: torch.Tensor  # [kept rows]: their index in the padded batch
    prompt_lengths: torch.Tensor  # [kept rows]: real prompt tokens, i.e. the column of the first completion token
    completion_lengths: torch.Tensor  # [batch]: real completion tokens of every row (0 for rows left out)
    completion_width: int  # the padded batch's completion columns, the width of what to_completion_layout returns


def unpad(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int, compiled: bool = False
) -> UnpaddedBatch:
    """The rows of a [prompt | completion] batch (TRL's layout: the last `completion_width` columns are the
    completion, each mask a contiguous run of ones) with their real tokens moved to the front. One host sync (the
    width and the rows kept). Rows with nothing to score are left out, but one still runs when none is scored (so the
    loss stays connected to the graph); with `compiled`, rows fill up to COMPILED_MIN_ROWS (as far as the batch has
    them) and the width is padded to a multiple of COMPILED_WIDTH_MULTIPLE. Rows and columns added score nothing
    (labels IGNORE) and read back as zeros."""
    mask = attention_mask.bool()
    completion_lengths = mask[:, -completion_width:].sum(1)
    prompt_lengths = mask.sum(1) - completion_lengths
    rows = (completion_lengths > 0).nonzero().squeeze(1)
    wanted = min(COMPILED_MIN_ROWS if compiled else 1, mask.size(0))
    if rows.numel() < wanted:
        fill = (completion_lengths == 0).nonzero().squeeze(1)[: wanted - rows.numel()]
        rows = torch.cat([rows, fill]).sort().values
    mask, lengths = mask[rows], (prompt_lengths + completion_lengths)[rows]
    # A stable sort on "is padding" puts each row's real tokens first, in their order.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices
    width = int(lengths.max())
    if compiled:
        width = -(-width // COMPILED_WIDTH_MULTIPLE) * COMPILED_WIDTH_MULTIPLE
    # Past a row's length sit its own padding tokens; columns past the batch's (a rounded width) repeat the last one.
    ids = input_ids[rows].gather(1, order)[:, :width]
    if width > ids.size(1):
        ids = torch.cat([ids, ids[:, -1:].expand(-1, width - ids.size(1))], 1)
    columns = torch.arange(width, device=ids.device)
    scored = (columns >= prompt_lengths[rows, None]) & (columns < lengths[:, None])
    return UnpaddedBatch(
        ids, ids.masked_fill(~scored, IGNORE), rows, prompt_lengths[rows], completion_lengths, completion_width
    )


def to_completion_layout(per_token: torch.Tensor, batch: UnpaddedBatch) -> torch.Tensor:
    """[kept rows, width - 1] values of the fused LM head (position t scores token t + 1) -> [batch, completion
    width] in TRL's layout: completion token j of a row at column j, zero past its completion and on rows left
    out (as TRL's fused head gives for a masked label)."""
    j = torch.arange(batch.completion_width, device=per_token.device)
    index = (batch.prompt_lengths[:, None] - 1 + j).clamp(0, per_token.size(1) - 1)
    kept = per_token.gather(1, index) * (j < batch.completion_lengths[batch.rows, None])
    out = kept.new_zeros(batch.completion_lengths.numel(), batch.completion_width)
    return out.index_copy(0, batch.rows, kept)


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_width: int,
    batch_size: int | None,
    compute_entropy: bool,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """TRL's per-token log-probs (and entropies) of the completion tokens, in TRL's layout, from forwards over the
    rows' real tokens only, `batch_size` rows at a time, through the fused LM head TRL puts on the model
    (model(input_ids, labels, fused_lm_head=True) -> .log_probs, .entropy); `autocast`: the trainer's; `compiled`:
    the model's decoder layers are torch.compiled (unpad's shapes that do not compile them again)."""
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        chunk = unpad(
            input_ids[start : start + batch_size],
            attention_mask[start : start + batch_size],
            completion_width,
            compiled,
        )
        with autocast():
            out = model(input_ids=chunk.input_ids, labels=chunk.labels, fused_lm_head=True)
        logps.append(to_completion_layout(out.log_probs, chunk))
        if compute_entropy:
            entropies.append(to_completion_layout(out.entropy, chunk))
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None
