"""The run's eval report (factory/runs/stages.py eval_summary): SFT (step 0) against the final step only."""

from __future__ import annotations

from factory.core.evaluate import EvalResult
from factory.runs.stages import eval_rows, eval_summary, render_report


def test_periodic_evals_do_not_stand_in_for_the_final_one(lake):
    for step, acc in ((0, 0.5), (20, 0.525), (40, 0.59)):  # the lake reads newest first: step 20 after 40
        result = EvalResult(accuracy=acc, pass_at_k=acc + 0.1, k=8, n=200, by_level={"add2": acc},
                            level_n={"add2": 200})
        lake.upsert("evals", eval_rows("r1", step, result, None))
    s = eval_summary(lake, "r1")
    assert (s["sft_accuracy"], s["grpo_accuracy"], s["final_step"]) == (0.5, 0.59, 40)
    assert s["levels"] == {"add2": {"sft": 0.5, "grpo": 0.59}}
    assert s["grpo_pass_at_8"] == 0.69
    assert "| add2 | 50.0% | 59.0% |" in render_report(s)
