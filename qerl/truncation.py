"""Completions cut at max_completion_length, watched round by round: the signs of a run locking itself at the cap.

A DAPO run masks truncated completions out of the loss. When the completions grow toward the cap, more and more of
them teach nothing, and once every completion of a round is truncated no token carries a gradient: the run cannot
leave that state (issue 49 found one run in eight of the real 1.5B stuck there). The rewards tell what is pushing:
where the truncated completions earn more than the finished ones (they wrote "#### N" and went on), they raise their
group's baseline and the finished completions' advantage falls; where they earn less, nothing but masking keeps
length from growing (what the length-cap sweep saw in the one run that locked: docs/benchmarks.md).

TruncationWatch takes each round's truncation flags and earned rewards (the task's reward functions, before any
length rule), adds two metrics beside TRL's completions/clipped_ratio (the mean reward of the truncated and of the
finished completions), says in one line when a run heads for the cap (the first round >= 90% truncated; every run
of 3 rounds in a row >= 50% truncated), and counts those rounds for the run's last log line. A resumed run counts
the rounds before the checkpoint from its logged history (one line a round at the recipes' logging_steps 1).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

MOSTLY = 0.5  # a round this truncated or more starts (or extends) a streak
STREAK = 3  # rounds in a row >= MOSTLY: said, before the lock-in rather than after
NEARLY_ALL = 0.9  # the first round this truncated is said; the arms report's "stuck" rule uses the same share
TRUNCATED_REWARD = "completions/truncated_reward_mean"
FINISHED_REWARD = "completions/finished_reward_mean"
SUMMARY_MOSTLY = "truncation/rounds_mostly_truncated"  # the run's last log line: rounds >= MOSTLY
SUMMARY_NEARLY_ALL = "truncation/rounds_nearly_all_truncated"  # rounds >= NEARLY_ALL


def _text(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}"


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if not math.isnan(v)]  # NaN: every reward function returned None for it
    return sum(finite) / len(finite) if finite else None


class TruncationWatch(TrainerCallback):
    """Watches each generation round's truncated completions (see the module docstring).

    `max_completion_length` and `masked` (mask_truncated_completions) shape the words of the warnings; `quiet`: a
    process that counts and logs but does not speak (every rank but the main one)."""

    def __init__(self, max_completion_length: int = 0, masked: bool = True, quiet: bool = False):
        self.max_completion_length = max_completion_length
        self.masked = masked
        self.quiet = quiet
        self.rounds = 0
        self.rounds_mostly = 0
        self.rounds_nearly_all = 0
        self.streak = 0  # rounds in a row >= MOSTLY, up to the last one observed
        self.said_nearly_all = False

    def observe(self, step: int, truncated: Sequence[bool], rewards: Sequence[float]) -> dict[str, float]:
        """One round: whether each completion was truncated and what it earned. Returns the round's metrics (the two
        means; a side with no completion is left out) and says what the module docstring says it says."""
        if len(truncated) != len(rewards):
            raise ValueError(f"{len(truncated)} truncation flags for {len(rewards)} rewards")
        if not truncated:
            return {}
        cut = _mean([r for r, t in zip(rewards, truncated, strict=True) if t])
        done = _mean([r for r, t in zip(rewards, truncated, strict=True) if not t])
        metrics = {
            name: value for name, value in ((TRUNCATED_REWARD, cut), (FINISHED_REWARD, done)) if value is not None
        }
        share = sum(truncated) / len(truncated)
        self._count(share)
        if share >= NEARLY_ALL and not self.said_nearly_all:
            self.said_nearly_all = True
            self._say(self._line(step, f"{share:.0%} of the round's completions", cut, done))
        elif self.streak == STREAK:
            self._say(self._line(step, f">= {MOSTLY:.0%} of the completions {STREAK} rounds in a row", cut, done))
        return metrics

    def _say(self, line: str) -> None:
        if not self.quiet:
            logger.warning(line)

    def _line(self, step: int, how_many: str, cut: float | None, done: float | None) -> str:
        rewards = f"mean reward truncated {_text(cut)}, finished {_text(done)}"
        if cut is not None and done is not None and cut > done:
            rewards += " (truncation pays more than stopping: the finished completions' advantage falls)"
        consequence = (
            "masked out of the loss, they teach nothing, and a round with every completion truncated has no gradient"
            if self.masked
            else "they stay in the loss"
        )
        cap = f" {self.max_completion_length}" if self.max_completion_length else ""
        return (
            f"step {step}: {how_many} hit max_completion_length{cap}; {rewards}; {consequence}. Ways out: "
            "--fail-truncated-completions true --mask-truncated-completions false, --soft-overlong-cache N, a longer "
            "--max-completion-length, a lower --learning-rate"
        )

    def _count(self, share: float) -> None:
        self.rounds += 1
        self.streak = self.streak + 1 if share >= MOSTLY else 0
        self.rounds_mostly += share >= MOSTLY
        self.rounds_nearly_all += share >= NEARLY_ALL

    def summary(self) -> dict[str, int]:
        """What the run's last log line adds: the rounds >= 50% and >= 90% truncated."""
        return {SUMMARY_MOSTLY: self.rounds_mostly, SUMMARY_NEARLY_ALL: self.rounds_nearly_all}

    def on_train_begin(self, args, state, control, **kwargs):
        """A resumed run: the rounds before its checkpoint, from the logged history (what was said stays said)."""
        if self.rounds or not state.global_step:
            return
        for line in state.log_history:
            share = line.get("completions/clipped_ratio")
            if share is not None:
                self._count(share)
        self.said_nearly_all = self.rounds_nearly_all > 0

    def on_train_end(self, args, state, control, **kwargs):
        if not self.quiet and self.rounds:
            logger.info(
                "truncation: %d of %d rounds had >= %.0f%% of their completions truncated, %d had >= %.0f%%",
                self.rounds_mostly,
                self.rounds,
                100 * MOSTLY,
                self.rounds_nearly_all,
                100 * NEARLY_ALL,
            )
