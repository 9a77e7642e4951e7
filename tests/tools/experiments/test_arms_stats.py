"""experiments.arms_stats against scipy on fresh random seed accuracies: the mean's t interval, Welch's difference of
means (its interval, degrees of freedom and p), TOST equivalence (which must agree with the 90% interval lying inside
the margin), and the F test of two spreads."""

import random
import statistics

import pytest
from scipy import stats

from experiments.arms_stats import mean_interval, paired, variance_ratio, welch


def _accuracies(rng, n, mean, sd):
    return [rng.gauss(mean, sd) for _ in range(n)]


@pytest.fixture
def rng(seed):
    return random.Random(seed)


def test_mean_interval_is_scipys_t_interval(rng):
    for n in (2, 3, 10, 17):
        values = _accuracies(rng, n, 0.62, 0.02)
        mean, half = mean_interval(values)
        low, high = stats.t.interval(0.95, n - 1, loc=statistics.fmean(values), scale=stats.sem(values))
        assert mean == pytest.approx((low + high) / 2) and half == pytest.approx((high - low) / 2)
    assert mean_interval([0.5]) == (0.5, 0.0)


def test_welch_is_scipys_unequal_variance_t_test(rng):
    for n_a, n_b in ((3, 3), (10, 10), (4, 9)):
        a, b = _accuracies(rng, n_a, 0.60, 0.03), _accuracies(rng, n_b, 0.62, 0.01)
        diff = welch(a, b)
        reference = stats.ttest_ind(a, b, equal_var=False)
        interval = reference.confidence_interval(0.95)
        assert diff.difference == pytest.approx(statistics.fmean(a) - statistics.fmean(b))
        assert (diff.low, diff.high) == (pytest.approx(interval.low), pytest.approx(interval.high))
        assert diff.p == pytest.approx(reference.pvalue) and diff.df == pytest.approx(reference.df)
    assert welch([0.5], [0.4, 0.6]) is None and welch([0.5, 0.5], [0.6, 0.6]) is None


def test_paired_is_scipys_related_samples_t_test(rng):
    """Two arms' accuracies sharing a per-seed effect (the seed's prompts): the paired difference's interval and p
    are scipy's ttest_rel's, its TOST agrees with the 90% interval, and pairing removes the shared effect that
    Welch's interval carries. The seeds' shared effects are spread evenly over +-3 points (in a random order): drawn
    at random, three of them can fall close together (3% of draws), and then Welch's interval, on more degrees of
    freedom, is the narrower."""
    for n in (3, 5, 12):
        shared = [0.03 * (2 * i / (n - 1) - 1) for i in range(n)]
        rng.shuffle(shared)
        a = [s + x for s, x in zip(shared, _accuracies(rng, n, 0.60, 0.005), strict=True)]
        b = [s + x for s, x in zip(shared, _accuracies(rng, n, 0.62, 0.005), strict=True)]
        diff = paired([x - y for x, y in zip(a, b, strict=True)], margin=0.02)
        reference = stats.ttest_rel(a, b)
        interval = reference.confidence_interval(0.95)
        assert (diff.low, diff.high) == (pytest.approx(interval.low), pytest.approx(interval.high))
        assert diff.p == pytest.approx(reference.pvalue) and diff.df == n - 1 and diff.n_a == diff.n_b == n
        inside = stats.ttest_rel(a, b).confidence_interval(0.90)
        assert diff.equivalent == (-0.02 < inside.low and inside.high < 0.02)
        assert diff.high - diff.low < welch(a, b).high - welch(a, b).low
    assert paired([0.01]) is None and paired([0.01, 0.01]) is None


def test_tost_says_equivalent_exactly_when_the_90_interval_is_inside_the_margin(rng):
    verdicts = set()
    for _ in range(200):
        n = rng.choice((3, 5, 10))
        a = _accuracies(rng, n, 0.62 + rng.uniform(-0.03, 0.03), rng.uniform(0.005, 0.03))
        b = _accuracies(rng, n, 0.62, rng.uniform(0.005, 0.03))
        diff = welch(a, b, margin=0.02)
        reference = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.90)
        inside = -0.02 < reference.low and reference.high < 0.02
        assert diff.equivalent == inside
        # Each one-sided test by scipy: difference > -margin, difference < +margin.
        above = stats.ttest_ind([x + 0.02 for x in a], b, equal_var=False, alternative="greater").pvalue
        below = stats.ttest_ind([x - 0.02 for x in a], b, equal_var=False, alternative="less").pvalue
        assert diff.p_equivalent == pytest.approx(max(above, below))
        verdicts.add(diff.equivalent)
    assert verdicts == {True, False}  # both verdicts were exercised


def test_variance_ratio_is_the_two_sided_f_test(rng):
    a, b = _accuracies(rng, 3, 0.6, 0.05), _accuracies(rng, 10, 0.6, 0.02)
    ratio, p = variance_ratio(a, b)
    assert ratio == pytest.approx(statistics.variance(a) / statistics.variance(b))
    one_sided = stats.f.sf(ratio, 2, 9)
    assert p == pytest.approx(min(1.0, 2 * min(one_sided, 1 - one_sided)))
    assert variance_ratio([0.5], b) is None and variance_ratio(a, [0.5, 0.5]) is None
