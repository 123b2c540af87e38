"""The run's eval report (factory/runs/stages.py eval_summary): SFT (step 0) against the run's result at its final
step only, every accuracy with its interval and n, and a winner only outside the noise."""

from __future__ import annotations

from factory.core.evaluate import EvalResult
from factory.runs.stages import eval_rows, eval_summary, render_report


def test_periodic_evals_do_not_stand_in_for_the_final_one(lake):
    for step, acc in ((0, 0.5), (20, 0.525), (40, 0.59)):  # the lake reads newest first: step 20 after 40
        result = EvalResult(accuracy=acc, pass_at_k=acc + 0.1, k=8, n=200, by_level={"add2": acc},
                            level_n={"add2": 100})
        lake.upsert("evals", eval_rows("r1", step, result, None))
    s = eval_summary(lake, "r1")
    assert (s["sft_accuracy"], s["grpo_accuracy"], s["final_step"], s["n"]) == (0.5, 0.59, 40, 200)
    assert s["levels"] == {"add2": {"sft": 0.5, "grpo": 0.59, "sft_n": 100, "grpo_n": 100}}
    assert s["grpo_pass_at_8"] == 0.69
    report = render_report(s)
    assert "| add2 | 0.500 [0.404, 0.596] n=100 | 0.590 [0.492, 0.681] n=100 |" in report
    assert "| GRPO (step 40) | 0.590 [0.521, 0.656] n=200 | 0.690 [0.623, 0.750] n=200 |" in report  # pass@k too


def _run_with_control(lake, grpo: float, control: float, n: int = 500) -> dict:
    for step, acc in ((0, 0.70), (60, grpo)):
        lake.upsert("evals", eval_rows("r", step, EvalResult(acc, None, 8, n, {}), None))
    lake.upsert("evals", [dict(r, metric=f"sft_control_{r['metric']}")
                          for r in eval_rows("r", 60, EvalResult(control, None, 8, n, {}), None)])
    return eval_summary(lake, "r")


def test_a_gap_inside_the_noise_is_no_win(lake):
    """The demo's case (issue 24): GRPO 0.764 vs the control's 0.744 on 500 problems printed "grpo wins"."""
    s = _run_with_control(lake, 0.764, 0.744)
    assert s["winner"] is None
    assert ("Control (same extra wall time): no significant difference between grpo and more sft "
            "(diff +0.020 [-0.033, +0.073], n=500 each).") in render_report(s)


def test_a_wide_gap_wins(lake):
    s = _run_with_control(lake, 0.764, 0.600)
    assert s["winner"] == "grpo"
    report = render_report(s)
    assert "Control (same extra wall time): grpo wins (diff +0.164 [+0.107, +0.220], n=500 each)." in report
    # no pass@k recorded: no pass@k column (it was a column of dashes)
    assert "| control: same wall time of more SFT | 0.600 [0.556, 0.642] n=500 |" in report.splitlines()
    assert "GRPO over SFT: grpo wins (diff +0.064 [+0.009, +0.118], n=500 each)." in report


def test_pass_at_k_is_shown_for_the_k_the_run_measured(lake):
    """The tiny demo (schedule.eval_pass_k=2) printed a "pass@8" column of dashes beside its pass@2 rows."""
    for step, acc in ((0, 0.5), (2, 0.6)):
        lake.upsert("evals", eval_rows("k2", step, EvalResult(acc, acc + 0.1, 2, 20, {}), None))
    report = render_report(eval_summary(lake, "k2"))
    assert "| checkpoint | greedy accuracy | pass@2 (T=1) |" in report
    assert "| GRPO (step 2) | 0.600 [0.387, 0.781] n=20 | 0.700 [0.481, 0.855] n=20 |" in report
