"""The heavy-tailed latency model: deterministic, the advertised shape, and its analytic limit."""

import pytest

from factory.envs.latency import LatencyProfile


def test_deterministic_and_shaped():
    p = LatencyProfile(unit_s=1.0)
    draws = [p.sample(f"ep-{i}") for i in range(20000)]
    assert draws[:50] == [p.sample(f"ep-{i}") for i in range(50)]
    share = {x: draws.count(x) / len(draws) for x in (1.0, 3.0, 20.0)}
    assert share == pytest.approx({1.0: 0.4, 3.0: 0.5, 20.0: 0.1}, abs=0.01)


def test_limit_hand_computed():
    p = LatencyProfile(unit_s=1.0)
    assert p.mean_s() == pytest.approx(0.4 * 1 + 0.5 * 3 + 0.1 * 20)
    # B=1: E[max] = mean; B=2: P(max=20)=1-.9^2=.19, P(max=3)=.9^2-.4^2=.65, P(max=1)=.16
    assert p.expected_max_s(1) == pytest.approx(p.mean_s())
    assert p.expected_max_s(2) == pytest.approx(0.19 * 20 + 0.65 * 3 + 0.16 * 1)
    assert 4.8 < p.sync_limit(32) < 5.2  # the "about 5x" of the default shape


def test_bad_fractions_rejected():
    with pytest.raises(ValueError, match="sum to 1"):
        LatencyProfile(short=(0.5, 1.0))
