"""The statistics of an evaluation's score (eval/statistics.py): the Wilson interval."""

from eval.statistics import wilson_interval


def test_wilson_interval():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(50, 100)
    assert abs(low - 0.4038) < 1e-3 and abs(high - 0.5962) < 1e-3
