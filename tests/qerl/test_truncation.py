"""TruncationWatch (qerl/truncation.py): the truncated vs finished reward of each round, the one-line warnings before a
run locks at the length cap, and the counts of the run's last line, also across a resume."""

import logging
import math
import random

import pytest
from transformers import TrainerState

from qerl.truncation import FINISHED_REWARD, SUMMARY_MOSTLY, SUMMARY_NEARLY_ALL, TRUNCATED_REWARD, TruncationWatch


def round_of(share: float, n: int = 64, cut_reward: float = 1.0, done_reward: float = 0.5, rng=None):
    """A round of n completions, the first round(share * n) truncated, each side's rewards around its mean."""
    rng = rng or random.Random(0)
    k = round(share * n)
    truncated = [True] * k + [False] * (n - k)
    rewards = [(cut_reward if t else done_reward) + rng.uniform(-0.1, 0.1) for t in truncated]
    return truncated, rewards


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "qerl.truncation" and r.levelno == logging.WARNING]


def test_means_of_each_side_match_a_direct_computation(seed):
    rng = random.Random(seed)
    truncated = [rng.random() < 0.3 for _ in range(64)]
    truncated[0], truncated[1] = True, False  # both sides present
    rewards = [rng.choice([0.0, 0.2, 1.0, 1.2]) for _ in truncated]
    rewards[5] = math.nan  # every reward function returned None: left out of its side's mean
    metrics = TruncationWatch().observe(1, truncated, rewards)
    for name, side in ((TRUNCATED_REWARD, True), (FINISHED_REWARD, False)):
        values = [r for r, t in zip(rewards, truncated, strict=True) if t == side and not math.isnan(r)]
        assert metrics[name] == pytest.approx(sum(values) / len(values), abs=1e-12)


def test_a_side_without_completions_is_left_out():
    assert set(TruncationWatch().observe(1, [False] * 8, [1.0] * 8)) == {FINISHED_REWARD}
    assert set(TruncationWatch().observe(1, [True] * 8, [1.0] * 8)) == {TRUNCATED_REWARD}
    assert TruncationWatch().observe(1, [], []) == {}
    with pytest.raises(ValueError, match="3 truncation flags for 2 rewards"):
        TruncationWatch().observe(1, [True, False, True], [1.0, 0.0])


def test_warns_once_at_the_first_nearly_all_round_and_at_each_streak_of_half(caplog):
    watch = TruncationWatch(max_completion_length=512)
    shares = [0.1, 0.55, 0.6, 0.7, 0.2, 0.5, 0.5, 0.95, 1.0, 1.0, 1.0, 0.3, 0.92]
    said_at = []
    with caplog.at_level(logging.WARNING, logger="qerl.truncation"):
        for step, share in enumerate(shares, start=1):
            before = len(warnings_of(caplog))
            watch.observe(step, *round_of(share))
            said_at += [step] * (len(warnings_of(caplog)) - before)
    # Step 4: the third round in a row >= 50%; step 8: the first >= 90% (also its streak's third round: said once);
    # neither the streak going on nor a later round >= 90% repeats it.
    assert said_at == [4, 8]
    lines = warnings_of(caplog)
    assert lines[0].startswith("step 4: >= 50% of the completions 3 rounds in a row hit max_completion_length 512")
    assert lines[1].startswith("step 8: 95% of the round's completions hit max_completion_length 512")
    # The truncated completions earned more: said, with the way out.
    assert all(
        "truncation pays more than stopping" in line and "--fail-truncated-completions" in line for line in lines
    )
    assert all("\n" not in line for line in lines)
    assert watch.summary() == {SUMMARY_MOSTLY: 10, SUMMARY_NEARLY_ALL: 5}


def test_streak_of_half_said_again_after_a_break(caplog):
    watch = TruncationWatch()
    with caplog.at_level(logging.WARNING, logger="qerl.truncation"):
        for step, share in enumerate([0.6, 0.6, 0.6, 0.1, 0.6, 0.6, 0.6], start=1):
            watch.observe(step, *round_of(share, cut_reward=0.2, done_reward=0.8))
    lines = warnings_of(caplog)
    assert [line.split(":")[0] for line in lines] == ["step 3", "step 7"]
    assert not any("pays more" in line for line in lines)  # the truncated ones earned less here


def test_quiet_ranks_count_but_do_not_speak(caplog):
    watch = TruncationWatch(quiet=True)
    with caplog.at_level(logging.INFO, logger="qerl.truncation"):
        for step in range(1, 5):
            watch.observe(step, *round_of(1.0))
        watch.on_train_end(None, TrainerState(), None)
    assert not [r for r in caplog.records if r.name == "qerl.truncation"]
    assert watch.summary() == {SUMMARY_MOSTLY: 4, SUMMARY_NEARLY_ALL: 4}


def test_the_run_end_line_counts_the_rounds(caplog):
    watch = TruncationWatch()
    for step, share in enumerate([0.0, 0.5, 0.9, 1.0], start=1):
        watch.observe(step, *round_of(share))
    with caplog.at_level(logging.INFO, logger="qerl.truncation"):
        watch.on_train_end(None, TrainerState(), None)
    assert "truncation: 3 of 4 rounds had >= 50% of their completions truncated, 2 had >= 90%" in caplog.text


def test_a_resumed_run_counts_the_rounds_before_its_checkpoint(caplog):
    state = TrainerState(global_step=4)
    state.log_history = [
        {"step": 1, "completions/clipped_ratio": 0.2, "loss": 0.1},
        {"step": 2, "completions/clipped_ratio": 0.6},
        {"step": 3, "completions/clipped_ratio": 0.95},
        {"step": 4, "completions/clipped_ratio": 0.7},
        {"step": 4, "train_runtime": 12.0},  # a closing line carries no ratio
    ]
    watch = TruncationWatch()
    watch.on_train_begin(None, state, None)
    assert watch.summary() == {SUMMARY_MOSTLY: 3, SUMMARY_NEARLY_ALL: 1}
    with caplog.at_level(logging.WARNING, logger="qerl.truncation"):
        watch.observe(5, *round_of(1.0))  # the streak goes on (4 rounds), >= 90% was said before the checkpoint
    assert not warnings_of(caplog)
    assert watch.summary() == {SUMMARY_MOSTLY: 4, SUMMARY_NEARLY_ALL: 2}
    fresh = TruncationWatch()
    fresh.on_train_begin(None, TrainerState(global_step=0), None)  # a new run: nothing counted
    assert fresh.summary() == {SUMMARY_MOSTLY: 0, SUMMARY_NEARLY_ALL: 0}
