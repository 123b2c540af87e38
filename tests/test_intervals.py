"""factory/intervals.py: Wilson and Newcombe intervals against Newcombe's (1998) published tables, the printed form
of an accuracy, and the verdict between two accuracies."""

from __future__ import annotations

import re

import pytest

from factory.intervals import Accuracy, accuracy_text, newcombe, share_interval, share_text, successes, verdict, wilson


# Newcombe (1998a), "Two-sided confidence intervals for the single proportion", Table I, method 3 (score, no
# continuity correction), to the 4 decimals published.
@pytest.mark.parametrize("k, n, low, high", [
    (81, 263, 0.2553, 0.3662),
    (15, 148, 0.0624, 0.1605),
    (0, 20, 0.0, 0.1611),
    (1, 29, 0.0061, 0.1718),
])
def test_wilson_matches_newcombe_1998_table(k, n, low, high):
    ci = wilson(k, n)
    assert (round(ci.low, 4), round(ci.high, 4)) == (low, high)


# Newcombe (1998b), "Interval estimation for the difference between independent proportions", Table II,
# method 10 (hybrid score, no continuity correction).
@pytest.mark.parametrize("k1, n1, k2, n2, low, high", [
    (56, 70, 48, 80, 0.0524, 0.3339),
    (9, 10, 3, 10, 0.1705, 0.8090),
    (5, 56, 0, 29, -0.0381, 0.1926),
    (0, 10, 0, 10, -0.2775, 0.2775),
])
def test_newcombe_matches_newcombe_1998_table(k1, n1, k2, n2, low, high):
    ci = newcombe(k1, n1, k2, n2)
    assert (round(ci.low, 4), round(ci.high, 4)) == (low, high)


def test_wilson_ends_are_exact_at_zero_and_n():
    assert wilson(0, 7).low == 0.0 and wilson(7, 7).high == 1.0


def test_an_accuracy_prints_with_its_interval_and_n():
    assert Accuracy(0.764, 500).text() == "0.764 [0.725, 0.799] n=500"
    assert accuracy_text(0.764, 500) == "0.764 [0.725, 0.799] n=500"
    assert accuracy_text(None, 500) == "—" and accuracy_text(0.5, None) == "0.500"


def test_no_significant_difference_inside_the_noise():
    """The demo's case (issue 24): 76.4% vs 74.4% on the same 500 problems is not a win."""
    v = verdict("grpo", Accuracy(0.764, 500), "more sft", Accuracy(0.744, 500))
    assert v.winner is None
    assert v.text() == ("no significant difference between grpo and more sft "
                        "(diff +0.020 [-0.033, +0.073], n=500 each)")


def test_a_wide_gap_wins_either_way_round():
    v = verdict("grpo", Accuracy(0.764, 500), "more sft", Accuracy(0.600, 500))
    assert v.winner == "grpo" and v.interval.low > 0
    assert v.text().startswith("grpo wins (diff +0.164 [+0.")
    w = verdict("a", Accuracy(0.2, 100), "b", Accuracy(0.5, 200))
    assert w.winner == "b" and w.text().endswith("n=100 and 200)")


@pytest.mark.parametrize("call, message", [
    (lambda: wilson(3, 0), "wilson: n must be a whole number of problems >= 1, got 0"),
    (lambda: wilson(6, 5), "wilson: k must be a whole number of successes in [0, n=5], got 6"),
    (lambda: successes(0.5, 0), "n: expected the number of problems evaluated (>= 1), got 0"),
    (lambda: successes(1.5, 10), "accuracy: expected a share in [0, 1], got 1.5"),
    (lambda: successes(0.123, 10), "accuracy 0.123 is not a count out of n=10"),
])
def test_bad_input_names_the_field(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_mean_over_seeds_and_welch():
    from factory.intervals import mean_interval, t975, welch

    ci = mean_interval([0.70, 0.72, 0.71])  # 0.71 +- t(2) 4.303 * 0.01 / sqrt(3)
    assert (round(ci.low, 4), round(ci.high, 4)) == (0.6852, 0.7348)
    d = welch([0.70, 0.72, 0.71], [0.60, 0.61, 0.62])  # equal variances, 3 each: df = 4, t = 2.776
    assert (round(d.low, 4), round(d.high, 4)) == (0.0773, 0.1227)
    assert welch([0.5, 0.5], [0.4, 0.4]) is None  # no spread: no claim
    wide = mean_interval([0.360, 0.556, 0.004])  # a real 3-seed point: the t interval is [-0.389, 1.002]
    assert (wide.low, round(wide.high, 4)) == (0.0, 1.0)
    seconds = mean_interval([5.54, 5.90, 5.86], bounded=False)  # not a share: nothing to clip to
    assert (round(seconds.low, 3), round(seconds.high, 3)) == (5.276, 6.257)
    assert (t975(2), t975(4.7), t975(45)) == (4.303, 2.776, 2.021)
    with pytest.raises(ValueError, match="mean_interval: a mean over seeds needs at least 2 values, got 1"):
        mean_interval([0.5])


def test_pass_at_k_gets_the_score_interval_which_is_wilsons_for_a_count_and_covers_a_mean_of_estimates():
    import random

    from factory.core.evaluate import pass_at_k_estimate  # heavy: torch (factory.core)

    assert share_interval(0.8, 100) == wilson(80, 100)  # a share k/n: Wilson's interval itself
    assert share_interval(0.0, 10).low == 0.0 and share_interval(1.0, 10).high == 1.0
    assert share_text(0.69, 200) == "0.690 [0.623, 0.750] n=200" and share_text(None, 5) == "—"
    # The unbiased pass@4 from 8 samples a problem, averaged over 100 problems whose solve rates differ: the
    # interval holds the true pass@4 in at least 95% of 400 seeded repeats (it is conservative for such a mean).
    rng = random.Random(0)
    rates = [rng.betavariate(0.6, 1.2) for _ in range(100)]
    truth = sum(1 - (1 - r) ** 4 for r in rates) / len(rates)
    covered = 0
    for _ in range(400):
        est = sum(pass_at_k_estimate(8, sum(rng.random() < r for _ in range(8)), 4) for r in rates) / len(rates)
        ci = share_interval(est, len(rates))
        covered += ci.low <= truth <= ci.high
    assert covered >= 0.95 * 400, covered


@pytest.mark.parametrize("p, n, message", [(1.5, 10, "p must be a share in"), (0.5, 0, "n must be a whole number")])
def test_share_interval_names_bad_input(p, n, message):
    with pytest.raises(ValueError, match=message):
        share_interval(p, n)
