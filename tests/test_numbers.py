"""Numbers for people: each rounded to what its name says it is (factory/numbers.py)."""

import math

import pytest

from factory.numbers import kind_of, shown, significant


@pytest.mark.parametrize(("name", "kind"), [
    ("final_accuracy", "fraction"), ("accuracy", "fraction"), ("pass@8", "fraction"), ("reward_mean", "fraction"),
    ("goodput", "fraction"), ("acc", "fraction"), ("ci_low", "fraction"), ("gain", "fraction"),
    ("wall_s", "seconds"), ("seconds", "seconds"), ("eta_s", "seconds"), ("elapsed", "seconds"),
    ("tokens_per_s", "rate"), ("tok/s", "rate"), ("throughput", "rate"),
    ("loss", "number"), ("kl", "number"), ("steps", "number"), ("staleness_max", "number"), ("", "number"),
])
def test_a_name_says_what_kind_of_number_it_holds(name, kind):
    assert kind_of(name) == kind


def test_each_kind_is_rounded_to_what_it_means():
    assert shown(0.7640000104904175, "accuracy") == "0.764" and shown(1.0, "pass@8") == "1.000"
    assert shown(93.4567, "wall_s") == "93.5" and shown(1234.5, "seconds") == "1234" and shown(7.0, "wall_s") == "7.0"
    assert shown(12345.6, "tokens_per_s") == "12300" and shown(0.012345, "tokens_per_s") == "0.0123"
    assert shown(0.000123456, "kl") == "0.0001235" and shown(2.5, "loss") == "2.5"
    assert [shown(v, "accuracy") for v in (math.nan, math.inf, -math.inf)] == ["nan", "inf", "-inf"]


def test_significant_figures_never_use_an_exponent():
    assert [significant(v, 3) for v in (12345.6, 999.5, 1.0, -0.00098765, 0.0)] == [
        "12300", "1000", "1.00", "-0.000988", "0"]
