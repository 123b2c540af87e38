"""factory/lake/results.py: a run's result is its primary benchmark's accuracy at its final evaluated step, with the
other benchmarks beside it by name; `factory runs`, `best`, the sweep summary and the run report all agree on it."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from factory.cli import main
from factory.home import FactoryPaths
from factory.lake import Lake
from factory.lake.results import RunOutcome, Score, outcomes_from_evals, primary_benchmark, run_outcome

T0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
HELD = "arithmetic_heldout"


def ev(run_id: str, step: int, benchmark: str, value: float, n: int, metric: str = "accuracy") -> dict:
    return dict(run_id=run_id, step=step, benchmark=benchmark, metric=metric, value=value, n=n, recorded_at=T0)


# The quickstart after its periodic evals (issue 24): held-out 0.764 of 500 and carry_chains 0.795 of 200 at the
# last step; averaging the two (the old `factory runs`) gave 0.7795.
QUICKSTART_EVALS = [
    ev("q", 0, HELD, 0.744, 500), ev("q", 0, HELD, 0.9, 500, "pass@8"),
    ev("q", 20, HELD, 0.75, 500), ev("q", 20, "carry_chains", 0.78, 200),
    ev("q", 60, HELD, 0.764, 500), ev("q", 60, "carry_chains", 0.795, 200), ev("q", 60, HELD, 0.93, 500, "pass@8"),
    ev("q", 60, f"{HELD}/add2", 0.99, 100),
]


@pytest.fixture
def quickstart(factory_home: FactoryPaths) -> FactoryPaths:
    """One finished 60-step run `q`, a member of sweep `s`, evaluated periodically on two benchmarks."""
    with Lake.open(factory_home) as lake:
        lake.upsert("runs", [dict(run_id="q", name="quickstart", status="succeeded", sweep_id="s", spec="{}",
                                  spec_fingerprint="f", code_version="c", seed=0, started_at=T0,
                                  ended_at=T0 + dt.timedelta(minutes=9))])
        lake.upsert("steps", [dict(run_id="q", step=s, weight_version=s, loss=1.0, reward_mean=0.5, recorded_at=T0)
                              for s in range(1, 61)])
        lake.upsert("evals", QUICKSTART_EVALS)
        lake.upsert("sweeps", [dict(sweep_id="s", member="s-m000", name="s", axes=json.dumps({"seed": 0}),
                                    spec="{}", status="succeeded", run_id="q", final_accuracy=0.764, created_at=T0,
                                    recorded_at=T0)])
    return factory_home


def test_the_result_is_the_primary_benchmark_at_the_final_step_with_the_others_beside_it():
    o = outcomes_from_evals(QUICKSTART_EVALS)["q"]
    assert (o.step, o.accuracy, o.n) == (60, 0.764, 500)
    assert o.others == {"carry_chains": Score("carry_chains", 0.795, 200)}
    assert o.primary.text() == "0.764 [0.725, 0.799] n=500"
    assert o.start == Score(HELD, 0.744, 500)  # the baseline: the same benchmark at step 0
    assert o.text() == ("arithmetic_heldout 0.764 [0.725, 0.799] n=500 at step 60, from 0.744 [0.704, 0.780] n=500 "
                        "at step 0 (carry_chains 0.795 [0.734, 0.845] n=200)")


def test_a_run_still_training_has_its_latest_primary_eval_and_only_what_was_evaluated_with_it():
    rows = [ev("r", 0, HELD, 0.5, 100), ev("r", 10, HELD, 0.6, 100), ev("r", 10, "carry_chains", 0.4, 50),
            ev("r", 20, "carry_chains", 0.45, 50)]  # carry_chains of step 20 landed before its held-out eval
    o = outcomes_from_evals(rows)["r"]
    assert (o.step, o.accuracy, set(o.others)) == (10, 0.6, {"carry_chains"}) and o.others["carry_chains"].value == 0.4


def test_the_primary_benchmark():
    assert primary_benchmark([HELD, "carry_chains", f"{HELD}/x"]) == HELD
    # a run on one blend source: that source's held-out set (its own task); on several, the task's split
    assert primary_benchmark([HELD, "source:chain_sum", "carry_chains"]) == "source:chain_sum"
    assert primary_benchmark([HELD, "source:add2", "source:add3"]) == HELD
    assert primary_benchmark(["arith", "arith/1"]) == "arith"  # the only whole benchmark a run recorded
    assert primary_benchmark(["a", "b"]) is None  # several, none the held-out split: no guess


def test_a_run_without_an_accuracy_eval_has_no_result(lake):
    lake.upsert("evals", [ev("p", 0, HELD, 0.8, 10, "pass@8")])
    assert run_outcome(lake, "p") == RunOutcome("p", None, None)
    assert run_outcome(lake, "p").text() == "no accuracy eval yet"


def test_runs_best_summary_and_report_agree_on_the_result(quickstart, capsys):
    from factory.cockpit.reports import compare_sweep
    from factory.runs.stages import eval_summary

    assert main(["runs", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["benchmark"], row["eval_step"], row["accuracy"], row["ci95"], row["n"]) == (
        HELD, 60, 0.764, "[0.725, 0.799]", 500)
    assert row["other_benchmarks"] == "carry_chains 0.795 [0.734, 0.845] n=200" and row["final_step"] == 60

    assert main(["best", "--metric", "accuracy", "--format", "json"]) == 0
    (best,) = json.loads(capsys.readouterr().out)
    assert (best["benchmark"], best["step"], best["value"], best["ci95"], best["n"]) == (
        HELD, 60, 0.764, "[0.725, 0.799]", 500)

    with Lake.open(quickstart) as lake:
        (member,) = compare_sweep(lake, "s").members
        summary = eval_summary(lake, "q")
    assert (member.accuracy, member.n, member.accuracy_text()) == (0.764, 500, "0.764 [0.725, 0.799] n=500")
    assert member.others == row["other_benchmarks"]
    assert (summary["grpo_accuracy"], summary["n"], summary["final_step"]) == (0.764, 500, 60)
    assert summary["others"] == {"carry_chains": {"accuracy": 0.795, "n": 200, "start_accuracy": None,
                                                  "start_n": None}}  # not evaluated at step 0
