"""benchmarks/packing_share.py on a few small batches: shares are shares, one packed row leaves at most the bucket's
end pad, and the trainer's layout (by its own estimate) never costs more than padding without a bucket."""

from __future__ import annotations

import importlib

ps = importlib.import_module("benchmarks.packing_share")


def test_the_counts_hold_together() -> None:
    cost = 8.7e-5  # qwen2_05b_pair_cost() (7 s to build the model on the meta device: left to the benchmark)
    r = ps.measure(8, 5, 1, 0, cost)
    assert 0 < r["padded_share"]["mean"] < 1 and r["packed_one_row_share"]["mean"] == 0.0
    assert r["packed_capped_share"]["mean"] <= r["padded_share"]["mean"]
    assert r["work_trainer_05b"]["p97.5"] <= 1.0 + 1e-12
    assert r["attention_varlen"]["mean"] < r["attention_capped_dense"]["mean"] <= 1.0 + 1e-12
    bucketed = ps.measure(8, 5, 128, 0, cost)
    assert 0 < bucketed["packed_one_row_share"]["p97.5"] < 127 / (8 * 200)
