"""The statistics of experiments.arms, over seeds: a mean's 95% t interval, the difference of two arms' means with
its Welch 95% interval (or, over the seeds both arms ran, the mean of their paired differences with its t interval),
equivalence within a margin by two one-sided tests (TOST), the F test of two spreads and Fisher's exact test of two
counts. The distributions come from scipy.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass


def _t():
    from scipy import stats  # imported on use: the experiments' runners need it only for the report

    return stats.t


def mean_interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t interval (n - 1 degrees of freedom; 0 for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, float(_t().ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))


@dataclass(frozen=True)
class Difference:
    """mean(a) - mean(b) over seeds: Welch's way (the arms' spreads need not be equal), or paired by seed."""

    n_a: int
    n_b: int
    difference: float
    low: float  # 95% interval
    high: float
    df: float  # Welch-Satterthwaite degrees of freedom
    p: float  # two-sided, difference = 0
    margin: float | None = None
    p_equivalent: float | None = None  # TOST: the larger one-sided p of |difference| >= margin; < 0.05: equivalent

    @property
    def equivalent(self) -> bool | None:
        return None if self.p_equivalent is None else self.p_equivalent < 0.05

    def as_dict(self) -> dict:
        return {**asdict(self), "equivalent": self.equivalent}


def welch(a: list[float], b: list[float], margin: float | None = None) -> Difference | None:
    """The difference of means with its Welch 95% interval and two-sided p; with a margin, the TOST p of
    equivalence within +-margin (equivalent at 5% exactly when the 90% interval lies inside the margin). None when
    an arm has fewer than two values, or neither varies (no interval can be formed)."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return None
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return _t_difference(len(a), len(b), statistics.fmean(a) - statistics.fmean(b), math.sqrt(va + vb), df, margin)


def paired(differences: list[float], margin: float | None = None) -> Difference | None:
    """The mean of per-seed differences a - b (a seed trains both arms on the same prompts in the same order, so
    what the prompts do to a run cancels) with its 95% t interval (n - 1 degrees of freedom), two-sided p and, with
    a margin, the TOST p. None under two pairs, or when the differences do not vary."""
    if len(differences) < 2 or statistics.stdev(differences) == 0:
        return None
    n = len(differences)
    se = statistics.stdev(differences) / math.sqrt(n)
    return _t_difference(n, n, statistics.fmean(differences), se, n - 1, margin)


def _t_difference(n_a: int, n_b: int, difference: float, se: float, df: float, margin: float | None) -> Difference:
    t = _t()
    half = float(t.ppf(0.975, df)) * se
    p = float(2 * t.sf(abs(difference) / se, df))
    p_equivalent = None
    if margin is not None:
        # H0: difference <= -margin (rejected for large t) and H0: difference >= +margin (rejected for small t).
        p_equivalent = float(max(t.sf((difference + margin) / se, df), t.cdf((difference - margin) / se, df)))
    return Difference(n_a, n_b, difference, difference - half, difference + half, df, p, margin, p_equivalent)


def variance_ratio(a: list[float], b: list[float]) -> tuple[float, float] | None:
    """var(a) / var(b) and the two-sided p of the F test that the spreads are equal (None below two values each or
    where b does not vary)."""
    if len(a) < 2 or len(b) < 2 or statistics.variance(b) == 0:
        return None
    from scipy import stats

    ratio = statistics.variance(a) / statistics.variance(b)
    tail = float(stats.f.sf(ratio, len(a) - 1, len(b) - 1))
    return ratio, min(1.0, 2 * min(tail, 1 - tail))


def fisher_exact(hits_a: int, n_a: int, hits_b: int, n_b: int) -> float:
    """Two-sided p of Fisher's exact test that hits_a of n_a and hits_b of n_b come from one rate."""
    from scipy import stats

    return float(stats.fisher_exact([[hits_a, n_a - hits_a], [hits_b, n_b - hits_b]]).pvalue)
