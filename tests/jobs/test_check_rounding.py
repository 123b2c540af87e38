"""What the quickstart's check shows in the Dagster UI: accuracies and their gain to 3 decimals, as everywhere."""

from __future__ import annotations

from assets.training import grpo_beats_sft


def test_the_gain_is_shown_to_three_decimals_not_as_a_float_difference():
    # 0.764 - 0.744 is 0.020000000000000018 in floating point
    res = grpo_beats_sft(grpo_run={"accuracy": 0.764, "start_accuracy": 0.744})
    assert res.passed
    assert {k: v.value for k, v in res.metadata.items()} == {"sft_accuracy": 0.744, "grpo_accuracy": 0.764,
                                                            "gain": 0.02}
