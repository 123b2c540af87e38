"""Intervals for accuracies: the Wilson score interval of a proportion (k of n) and Newcombe's hybrid score
interval for the difference of two independent proportions, the text Factory prints them as
(`0.764 [0.725, 0.799] n=500`; pass@k, a mean of per-problem values, gets the same score interval, which is
conservative for it: `share_interval`), and the verdict between two accuracies ("wins" only when the interval of the
difference excludes 0).

Pure Python (math only), so any layer may import it. Both intervals are those of Newcombe (1998): the Wilson
interval without continuity correction ("Two-sided confidence intervals for the single proportion", method 3)
and the hybrid score interval built from the two Wilson intervals ("Interval estimation for the difference
between independent proportions", method 10); tests/test_intervals.py checks them against his published tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def _check_counts(k: int, n: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what}: n must be a whole number of problems >= 1, got {n!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
        raise ValueError(f"{what}: k must be a whole number of successes in [0, n={n}], got {k!r}")


def wilson(k: int, n: int, z: float = Z95) -> Interval:
    """The Wilson score interval of the proportion k/n (95% by default), without continuity correction."""
    _check_counts(k, n, "wilson")
    return _score(k / n, n, z)


def _score(p: float, n: int, z: float) -> Interval:
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    denom = 1 + z * z / n
    # Exact ends at 0 and 1: the formula gives them up to rounding (-1e-17 is not a proportion).
    low = 0.0 if p == 0 else (centre - half) / denom
    high = 1.0 if p == 1 else (centre + half) / denom
    return Interval(low, high)


def share_interval(p: float, n: int, z: float = Z95) -> Interval:
    """Wilson's score interval around a mean `p` of n values in [0, 1] (95%): for a share k/n of right answers it is
    `wilson(k, n)`; for a mean of per-problem estimates (pass@k, unbiased from n samples a problem) it is
    conservative, since a mean of values in [0, 1] varies at most as much as a proportion with the same mean
    (variance <= p(1-p)/n). How pass@k is given an interval, whichever way it was measured."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"share_interval: n must be a whole number of problems >= 1, got {n!r}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"share_interval: p must be a share in [0, 1], got {p!r}")
    return _score(p, n, z)


def share_text(value: float | None, n: int | None) -> str:
    """A pass@k (or any mean of per-problem values in [0, 1]) as Factory prints it: `0.812 [0.775, 0.844] n=500`
    (`share_interval`); the value alone without n; '—' without a value."""
    if value is None:
        return "—"
    if not n:
        return f"{value:.3f}"
    ci = share_interval(value, int(n))
    return f"{value:.3f} [{ci.low:.3f}, {ci.high:.3f}] n={n}"


def newcombe(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> Interval:
    """Newcombe's hybrid score interval for p1 - p2 = k1/n1 - k2/n2 of two independent proportions (95%)."""
    _check_counts(k1, n1, "newcombe (first proportion)")
    _check_counts(k2, n2, "newcombe (second proportion)")
    return _hybrid(k1 / n1, wilson(k1, n1, z), k2 / n2, wilson(k2, n2, z))


def share_difference(p1: float, n1: int, p2: float, n2: int, z: float = Z95) -> Interval:
    """Newcombe's hybrid interval for p1 - p2 built from the two `share_interval`s (95%): `newcombe` for shares
    k/n, conservative for means of per-problem values such as pass@k."""
    return _hybrid(p1, share_interval(p1, n1, z), p2, share_interval(p2, n2, z))


def _hybrid(p1: float, w1: Interval, p2: float, w2: Interval) -> Interval:
    d = p1 - p2
    return Interval(d - math.sqrt((p1 - w1.low) ** 2 + (w2.high - p2) ** 2),
                    d + math.sqrt((w1.high - p1) ** 2 + (p2 - w2.low) ** 2))


def successes(accuracy: float, n: int) -> int:
    """The count of right answers behind an accuracy recorded as a share of n problems (k = accuracy * n, which
    is whole up to float rounding); ValueError when it is not a share of n (e.g. a pass@k estimate)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected the number of problems evaluated (>= 1), got {n!r}")
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy: expected a share in [0, 1], got {accuracy!r}")
    k = round(accuracy * n)
    if abs(k - accuracy * n) > 1e-6 * n:
        raise ValueError(f"accuracy {accuracy!r} is not a count out of n={n} (k={accuracy * n:.4f}); "
                         "an interval needs k of n right answers")
    return k


@dataclass(frozen=True)
class Accuracy:
    """An accuracy measured on n problems: its value, n and its 95% Wilson interval."""

    value: float
    n: int

    @property
    def k(self) -> int:
        return successes(self.value, self.n)

    def interval(self) -> Interval:
        return wilson(self.k, self.n)

    def text(self) -> str:
        """`0.764 [0.725, 0.799] n=500`: three decimals, which is what an accuracy on hundreds of problems means."""
        ci = self.interval()
        return f"{self.value:.3f} [{ci.low:.3f}, {ci.high:.3f}] n={self.n}"


def accuracy_text(value: float | None, n: int | None) -> str:
    """An accuracy as Factory prints it: with its interval and n when n is known, else the value alone, else '—'."""
    if value is None:
        return "—"
    if not n:
        return f"{value:.3f}"
    try:
        return Accuracy(value, int(n)).text()
    except ValueError:  # not a count out of n (an average): no interval to give
        return f"{value:.3f} n={n}"


@dataclass(frozen=True)
class Verdict:
    """Which of two accuracies is better, if the difference says so. `diff` = a - b, `interval` its 95% interval."""

    a: str
    b: str
    diff: float
    interval: Interval
    n_a: int
    n_b: int

    @property
    def winner(self) -> str | None:
        """`a`'s or `b`'s name when the difference's interval excludes 0; None: no significant difference."""
        if not self.interval.excludes_zero():
            return None
        return self.a if self.diff > 0 else self.b

    def detail(self) -> str:
        """`diff +0.020 [-0.034, +0.074], n=500 each` (the difference is a - b)."""
        ns = f"n={self.n_a} each" if self.n_a == self.n_b else f"n={self.n_a} and {self.n_b}"
        return f"diff {self.diff:+.3f} [{self.interval.low:+.3f}, {self.interval.high:+.3f}], {ns}"

    def text(self) -> str:
        """`grpo wins (diff +0.060 [+0.012, +0.107], n=500 each)` or `no significant difference (diff ...)`."""
        if self.winner is None:
            return f"no significant difference between {self.a} and {self.b} ({self.detail()})"
        return f"{self.winner} wins ({self.detail()})"


def verdict(a: str, acc_a: Accuracy, b: str, acc_b: Accuracy) -> Verdict:
    """Compare accuracy `acc_a` (named `a`) with `acc_b` (named `b`) by Newcombe's interval of a - b at 95%."""
    return Verdict(a, b, acc_a.value - acc_b.value, newcombe(acc_a.k, acc_a.n, acc_b.k, acc_b.n), acc_a.n, acc_b.n)


# ---------------------------------------------------------------- means over seeds

# Student's t 97.5% quantiles (a two-sided 95% interval) by degrees of freedom; between rows the smaller df's value
# is used, which is conservative (wider).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: float) -> float:
    """Student's t 97.5% quantile for `df` degrees of freedom (>= 1), from the table (conservative between rows)."""
    if not df >= 1:
        raise ValueError(f"df: expected degrees of freedom >= 1, got {df!r}")
    return _T975[max(k for k in _T975 if k <= df)] if df < 1000 else Z95


def _mean_var(values: list[float], what: str) -> tuple[float, float]:
    if len(values) < 2:
        raise ValueError(f"{what}: a mean over seeds needs at least 2 values, got {len(values)}")
    m = sum(values) / len(values)
    return m, sum((v - m) ** 2 for v in values) / (len(values) - 1)


def mean_interval(values: list[float], bounded: bool = True) -> Interval:
    """The 95% t interval of the mean of `values` (one accuracy per seed): what another seed's run would average
    to, seed-to-seed variation and eval noise both included. Clipped to [0, 1], where an accuracy lies (with 3
    seeds far apart the t interval reaches past either end); `bounded=False` for values not in [0, 1] (seconds)."""
    m, var = _mean_var(values, "mean_interval")
    half = t975(len(values) - 1) * math.sqrt(var / len(values))
    if not bounded:
        return Interval(m - half, m + half)
    return Interval(max(0.0, m - half), min(1.0, m + half))


def welch(a: list[float], b: list[float]) -> Interval | None:
    """Welch's 95% interval for mean(a) - mean(b) (per-seed accuracies of two sweep points); None when both sets
    agree exactly within themselves (no spread to measure the noise by: no claim either way)."""
    ma, va = _mean_var(a, "welch (first)")
    mb, vb = _mean_var(b, "welch (second)")
    sa, sb = va / len(a), vb / len(b)
    if sa + sb == 0:
        return None
    df = (sa + sb) ** 2 / (sa ** 2 / (len(a) - 1) + sb ** 2 / (len(b) - 1))
    half = t975(df) * math.sqrt(sa + sb)
    return Interval(ma - mb - half, ma - mb + half)
