"""Which rows the next generation round will sample, known while this round trains (rollout_max_staleness 1).

TRL's train sampler (RepeatSampler) fixes an epoch's order when the dataloader starts the epoch, and yields each
round's rows `repeats` times in a row (num_iterations x steps_per_generation: the micro-steps that reuse a round), so
the dataloader hands the trainer the next round's rows only when that round begins. To sample it ahead on the rollout
servers, the trainer records the order as the sampler makes it (`RecordedOrder`), numbers the dataset's rows (a
column, ROW, that every round's inputs carry), finds its round's rows in the order and reads the ones after.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

from torch.utils.data import Sampler

from qerl.errors import UsageError

ROW = "qerl_row"  # the dataset column holding each row's index, added when rounds are sampled ahead


def number_rows(dataset):
    """`dataset` (a datasets.Dataset) with each row's index in column ROW."""
    if not hasattr(dataset, "map") or not hasattr(dataset, "__getitem__"):
        raise UsageError(
            f"rollout_max_staleness 1 reads the next round's rows ahead, which a {type(dataset).__name__} "
            "cannot give: pass a datasets.Dataset, or rollout_max_staleness 0"
        )
    return dataset.map(lambda _, index: {ROW: index}, with_indices=True)


class RecordedOrder(Sampler):
    """A sampler as it is, its current epoch's order kept in `order` when the dataloader starts the epoch."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.order: list[int] = []

    def __iter__(self) -> Iterator[int]:
        self.order = list(self.sampler)
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.sampler) if isinstance(self.sampler, Sized) else len(self.order)


def rows_after(order: list[int], rows: list[int], repeats: int) -> list[int] | None:
    """The rows of the round after the one sampling `rows` (as the sampler yields them, `repeats` times each round),
    or None when that round is in the next epoch, whose order is not drawn yet, or `rows` is no round of `order`."""
    span = len(rows) * repeats
    for start in range(0, len(order), span):
        if order[start : start + len(rows)] == rows:
            after = order[start + span : start + span + len(rows)]
            return after if len(after) == len(rows) else None
    return None


class RoundsAhead:
    """The trainer's view of the rounds to come: `sampler` wraps TRL's train sampler, `taken` records the rows of the
    round the trainer samples now, `next_rows` gives the rows of the round after it (None where not known yet)."""

    def __init__(self, repeats: int):
        self.repeats = repeats  # micro-steps that reuse one round: num_iterations x steps_per_generation
        self.recorded: RecordedOrder | None = None
        self.rows: list[int] = []

    def sampler(self, sampler: Sampler) -> RecordedOrder:
        self.recorded = RecordedOrder(sampler)
        return self.recorded

    def taken(self, inputs: list[dict]) -> None:
        self.rows = [row[ROW] for row in inputs]

    def next_rows(self) -> list[int] | None:
        if self.recorded is None or not self.rows:
            return None
        return rows_after(self.recorded.order, self.rows, self.repeats)
