"""`factory best` and `factory compare`: ranking by final eval, filters, errors, and a two-run comparison,
through main(argv) over a lake with three recorded runs."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from factory.cli import main
from factory.home import FactoryPaths
from factory.lake import Lake
from factory.lake.history import flatten_spec, spec_diff

T0 = dt.datetime(2025, 6, 7, 8, 9, 10, tzinfo=dt.UTC)

SPEC_1 = {"name": "base", "seed": 1, "model": {"preset": "micro"}, "data": {"sources": ["a", "b"]},
          "algorithm": {"lr": 1e-4, "group_size": 8}, "schedule": {"steps": 12, "mode": "sync"}}
SPEC_2 = {**SPEC_1, "seed": 2, "algorithm": {"lr": 3e-4, "group_size": 8},
          "schedule": {"steps": 12, "mode": "async"}, "buffer": {"max_staleness": 2}}
SPEC_3 = {**SPEC_1, "seed": 3}


@pytest.fixture
def history(factory_home: FactoryPaths) -> FactoryPaths:
    """r1, r2 in sweep s1, r3 alone. Final arith accuracy: r2 0.75 > r1 0.6; r3 failed at step 10 (0.4, though it
    reached 0.9 at step 5): it has no final result, so `best` ranks it only at a common step (`--step`)."""
    with Lake.open(factory_home) as lake:
        base = dict(spec_fingerprint="f", code_version="c", status="succeeded", started_at=T0)
        lake.upsert("runs", [
            dict(base, run_id="r1", name="lr-1e-4", sweep_id="s1", seed=1, spec=SPEC_1),
            dict(base, run_id="r2", name="lr-3e-4", sweep_id="s1", seed=2, spec=SPEC_2),
            dict(base, run_id="r3", name="solo", seed=3, status="failed", spec=SPEC_3),
        ])
        ev = dict(n=100, recorded_at=T0, benchmark="arith", metric="accuracy")
        lake.upsert("evals", [
            dict(ev, run_id="r1", step=0, value=0.1), dict(ev, run_id="r1", step=12, value=0.6),
            dict(ev, run_id="r1", step=12, metric="pass@4", value=0.8),
            dict(ev, run_id="r1", step=12, benchmark="arith/1", value=0.9),
            dict(ev, run_id="r2", step=0, value=0.1), dict(ev, run_id="r2", step=12, value=0.75),
            dict(ev, run_id="r2", step=12, metric="pass@4", value=0.85),
            dict(ev, run_id="r3", step=5, value=0.9), dict(ev, run_id="r3", step=10, value=0.4),
        ])
        lake.upsert("steps", [
            dict(run_id="r1", step=s, weight_version=s, reward_mean=s / 10, trainer_idle_fraction=0.5,
                 staleness_max=float(s % 3), logprob_mismatch=0.01 * s, recorded_at=T0) for s in range(12)
        ] + [
            dict(run_id="r2", step=s, weight_version=s, reward_mean=1.0, trainer_idle_fraction=0.1,
                 staleness_max=0.0, logprob_mismatch=0.0, recorded_at=T0) for s in range(3)
        ])
    return factory_home


def run_json(argv: list[str], capsys) -> object:
    assert main([*argv, "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def run_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("factory: error: ") and err.count("\n") == 1
    return err


# -- best ------------------------------------------------------------------------------------------

def test_best_ranks_by_the_final_eval(history, capsys):
    rows = run_json(["best", "--metric", "accuracy"], capsys)
    assert [(r["rank"], r["run_id"], r["step"], r["value"]) for r in rows] == [(1, "r2", 12, 0.75), (2, "r1", 12, 0.6)]
    r2 = rows[0]
    assert r2 == dict(rank=1, run_id="r2", name="lr-3e-4", sweep_id="s1", status="succeeded", seed=2,
                      benchmark="arith", metric="accuracy", at="final", step=12, value=0.75, ci95="[0.657, 0.825]",
                      n=100)


def _pruned_member(history) -> None:
    """p1 of sweep s1, pruned at step 6: its accuracy then beats r1's final one, and its pass@4 is its step-0 one."""
    with Lake.open(history) as lake:
        lake.upsert("runs", [dict(spec_fingerprint="f", code_version="c", status="pruned", started_at=T0, run_id="p1",
                                  name="lr-1e-3", sweep_id="s1", seed=4, spec=SPEC_1)])
        ev = dict(n=100, recorded_at=T0, benchmark="arith", run_id="p1")
        lake.upsert("evals", [dict(ev, step=0, metric="accuracy", value=0.1), dict(ev, step=0, metric="pass@4",
                                                                                  value=0.95),
                              dict(ev, step=6, metric="accuracy", value=0.7)])


def test_best_ranks_final_results_only_and_says_which_it_left_out(history, capsys):
    """Issue 32: a pruned member ranked by its step-0 pass@8 (the SFT start), and a member pruned at an earlier step
    above a finished one."""
    _pruned_member(history)
    assert [r["run_id"] for r in run_json(["best", "--metric", "pass@4"], capsys)] == ["r2", "r1"]
    rows = run_json(["best", "--metric", "accuracy", "--sweep", "s1"], capsys)
    assert [(r["run_id"], r["at"], r["step"]) for r in rows] == [("r2", "final", 12), ("r1", "final", 12)]
    assert main(["best", "--metric", "accuracy"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("ranked: final results: runs that succeeded, each at its final evaluated step; not ranked: "
                       "1 failed: r3 (step 10); 1 pruned: p1 (step 6); --step N ranks every run at step N")
    # like beside like at one step: every run that recorded it there, whatever its status
    at0 = run_json(["best", "--metric", "pass@4", "--step", "0"], capsys)
    assert [(r["run_id"], r["at"], r["status"]) for r in at0] == [("p1", "step 0", "pruned")]
    at12 = run_json(["best", "--metric", "accuracy", "--step", "12"], capsys)
    assert [r["run_id"] for r in at12] == ["r2", "r1"]
    assert main(["best", "--metric", "accuracy", "--step", "12"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ("ranked: every run that recorded it at step 12; not ranked: "
                                                        "1 failed: r3 (step 10); 1 pruned: p1 (step 6)")


def test_best_lowest_top_and_sweep(history, capsys):
    assert [r["run_id"] for r in run_json(["best", "--metric", "accuracy", "--lowest"], capsys)] == ["r1", "r2"]
    assert [r["run_id"] for r in run_json(["best", "--metric", "accuracy", "--lowest", "--step", "10"],
                                          capsys)] == ["r3"]
    assert [r["run_id"] for r in run_json(["best", "--metric", "accuracy", "--top", "1"], capsys)] == ["r2"]
    assert [r["run_id"] for r in run_json(["best", "--metric", "accuracy", "--sweep", "s1"], capsys)] == ["r2", "r1"]
    rows = run_json(["best", "--metric", "accuracy", "--sweep", "s1", "--lowest", "--top", "1"], capsys)
    assert [r["run_id"] for r in rows] == ["r1"]


def test_best_on_a_slice_and_another_metric(history, capsys):
    assert [(r["run_id"], r["value"]) for r in run_json(
        ["best", "--metric", "accuracy", "--benchmark", "arith/1"], capsys)] == [("r1", 0.9)]
    assert [(r["run_id"], r["ci95"], r["n"]) for r in run_json(["best", "--metric", "pass@4"], capsys)] == [
        ("r2", "[0.767, 0.907]", 100), ("r1", "[0.711, 0.867]", 100)]  # pass@k with its 95% interval and n


def test_best_table_and_csv(history, capsys):
    assert main(["best", "--metric", "accuracy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["rank", "run_id", "name", "sweep_id", "status", "seed", "benchmark", "metric",
                                "at", "step", "value", "ci95", "n"]
    assert lines[2].split()[:3] == ["1", "r2", "lr-3e-4"] and lines[-2] == "(2 rows)"
    assert lines[-1].startswith("ranked: final results")
    assert main(["best", "--metric", "accuracy", "-f", "csv", "--top", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        '1,r2,lr-3e-4,s1,succeeded,2,arith,accuracy,final,12,0.75,"[0.657, 0.825]",100',
        '2,r1,lr-1e-4,s1,succeeded,1,arith,accuracy,final,12,0.6,"[0.502, 0.691]",100']


def test_best_unknown_metric_lists_the_metrics(history, capsys):
    err = run_error(["best", "--metric", "acc"], capsys)
    assert "--metric: no eval recorded metric 'acc'; metrics: accuracy, pass@4" in err


def test_best_unknown_benchmark_and_sweep_and_bad_top(history, capsys):
    err = run_error(["best", "--metric", "pass@4", "--benchmark", "arith/1"], capsys)
    assert "no eval of 'pass@4' on benchmark 'arith/1'; benchmarks with 'pass@4': arith" in err
    assert "--sweep: no run belongs to sweep 'nope'" in run_error(["best", "--metric", "accuracy", "--sweep", "nope"],
                                                                   capsys)
    assert "--top: must be >= 1, got 0" in run_error(["best", "--metric", "accuracy", "--top", "0"], capsys)


def test_best_asks_for_a_benchmark_when_several_whole_ones_have_the_metric(history, capsys):
    with Lake.open(history) as lake:
        lake.upsert("evals", [dict(run_id="r3", step=10, benchmark="gsm", metric="accuracy", value=0.2, n=10,
                                   recorded_at=T0)])
    err = run_error(["best", "--metric", "accuracy"], capsys)
    assert "recorded on several benchmarks; pass --benchmark, one of: arith, gsm" in err
    assert run_json(["best", "--metric", "accuracy", "--benchmark", "gsm"], capsys) == []  # r3 failed: no final
    assert [r["run_id"] for r in run_json(["best", "--metric", "accuracy", "--benchmark", "gsm", "--step", "10"],
                                          capsys)] == ["r3"]
    # Within sweep s1 only arith has accuracy, so no choice is needed there.
    assert [r["run_id"] for r in run_json(["best", "--metric", "accuracy", "--sweep", "s1"], capsys)] == ["r2", "r1"]


def test_best_on_an_empty_lake(factory_home, capsys):
    assert "metrics: none: no evals recorded yet" in run_error(["best", "--metric", "accuracy"], capsys)


# -- compare ---------------------------------------------------------------------------------------

def test_compare_json_is_one_object_with_every_section(history, capsys):
    c = run_json(["compare", "r1", "r2"], capsys)
    assert set(c) == {"a", "b", "spec", "evals", "steps"}
    assert c["a"]["run_id"] == "r1" and c["b"]["name"] == "lr-3e-4" and c["b"]["started_at"] == T0.isoformat()
    assert c["spec"] == [
        {"path": "algorithm.lr", "a": 1e-4, "b": 3e-4},
        {"path": "buffer.max_staleness", "b": 2},  # absent from A's spec: no "a" key
        {"path": "schedule.mode", "a": "sync", "b": "async"},
        {"path": "seed", "a": 1, "b": 2},
    ]
    evals = {(e["benchmark"], e["metric"]): e for e in c["evals"]}
    assert list(evals) == [("arith", "accuracy"), ("arith", "pass@4"), ("arith/1", "accuracy")]
    acc = evals[("arith", "accuracy")]
    assert (acc["at"], acc["step_a"], acc["a"], acc["step_b"], acc["b"]) == ("final", 12, 0.6, 12, 0.75)
    assert (acc["ci95_a"], acc["n_a"], acc["ci95_b"], acc["n_b"]) == ("[0.502, 0.691]", 100, "[0.657, 0.825]", 100)
    assert (acc["difference"], acc["difference_ci95"], acc["verdict"]) == (0.15, "[+0.020, +0.273]", "B better")
    # pass@k has its interval too (the score interval around a mean of per-problem values), and so has the difference
    passes = evals[("arith", "pass@4")]
    assert (passes["ci95_a"], passes["n_a"], passes["ci95_b"], passes["n_b"]) == (
        "[0.711, 0.867]", 100, "[0.767, 0.907]", 100)
    assert (passes["difference"], passes["difference_ci95"], passes["verdict"]) == (
        0.05, "[-0.056, +0.156]", "no significant difference")
    assert evals[("arith/1", "accuracy")] == dict(
        benchmark="arith/1", metric="accuracy", at="A only", step_a=12, a=0.9, ci95_a="[0.826, 0.945]", n_a=100,
        step_b=None, b=None, ci95_b=None, n_b=None, difference=None, difference_ci95=None, verdict=None)
    steps = {s["aggregate"]: s for s in c["steps"]}
    assert (steps["steps"]["a"], steps["steps"]["b"], steps["steps"]["difference"]) == (12, 3, -9)
    assert steps["last_step"]["a"] == 11
    assert steps["reward_mean_last10"]["a"] == pytest.approx(sum(s / 10 for s in range(2, 12)) / 10)
    assert steps["reward_mean_last10"]["b"] == 1.0
    assert steps["trainer_idle_fraction_mean"]["a"] == 0.5
    assert steps["trainer_idle_fraction_mean"]["b"] == pytest.approx(0.1)
    assert steps["staleness_max"]["a"] == 2.0
    assert steps["logprob_mismatch_max"]["a"] == pytest.approx(0.11)


def test_compare_sets_the_runs_sampler_trainer_gap_side_by_side(history, capsys):
    """r1 measured the gap on its last 3 steps (a run recorded before issue 35 holds NULL on the others); r2 measured
    none: its aggregates are null, not 0, and so is the difference."""
    with Lake.open(history) as lake:
        rows = lake.read("steps", "run_id == 'r1'").to_pylist()
        gap = {9: (0.01, 1e-4, 0.0, 0.2, 0.00), 10: (0.03, 9e-4, 0.01, 0.3, 0.02), 11: (0.02, 4e-4, 0.0, 0.4, 0.01)}
        lake.upsert("steps", [dict(r, gap_abs_mean=g[0], gap_kl=g[1], gap_out_frac=g[2], recompute_s=g[3],
                                   correction_masked_tokens=g[4]) for r in rows if (g := gap.get(r["step"]))])
    steps = {s["aggregate"]: s for s in run_json(["compare", "r1", "r2"], capsys)["steps"]}
    assert steps["gap_abs_mean_mean"]["a"] == pytest.approx(0.02)
    assert (steps["gap_kl_max"]["a"], steps["gap_out_frac_max"]["a"]) == (9e-4, 0.01)
    assert steps["recompute_s_mean"]["a"] == pytest.approx(0.3)
    assert steps["correction_masked_tokens_mean"]["a"] == pytest.approx(0.01)
    assert all(steps[k]["b"] is None and steps[k]["difference"] is None for k in (
        "gap_abs_mean_mean", "gap_kl_max", "gap_out_frac_max", "recompute_s_mean", "correction_masked_tokens_mean"))
    assert steps["steps"]["a"] == 12  # the gap rows replaced r1's, they added none


def test_compare_table(history, capsys):
    assert main(["compare", "r1", "r2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A: r1  lr-1e-4  succeeded  seed 1  sweep s1\nB: r2  lr-3e-4  succeeded  seed 2  sweep s1\n")
    lines = out.splitlines()
    assert "spec fields that differ (4)" in lines
    assert ["buffer.max_staleness", "(absent)", "2"] in [ln.split() for ln in lines]
    assert ["schedule.mode", "sync", "async"] in [ln.split() for ln in lines]
    assert ["arith", "accuracy", "final", "0.600", "[0.502,", "0.691]", "n=100", "0.750", "[0.657,", "0.825]", "n=100",
            "+0.150", "[+0.020,", "+0.273]", "B", "better"] in [ln.split() for ln in lines]
    assert ["steps", "12", "3", "-9"] in [ln.split() for ln in lines]


def test_compare_sets_like_beside_like_while_a_run_still_trains(history, capsys):
    """r4 is still training with evals at steps 0 and 6 only: its step-0 value is set beside r1's step-0 value,
    never beside r1's final one (issue 24), and the output says which step."""
    with Lake.open(history) as lake:
        lake.upsert("runs", [dict(run_id="r4", name="late", seed=4, spec=SPEC_1, spec_fingerprint="f",
                                  code_version="c", status="running", started_at=T0)])
        lake.upsert("evals", [dict(run_id="r4", step=s, benchmark="arith", metric=m, value=v, n=100, recorded_at=T0)
                              for s, m, v in [(0, "accuracy", 0.1), (6, "accuracy", 0.3), (0, "pass@4", 0.2)]])
    evals = {(e["benchmark"], e["metric"]): e for e in run_json(["compare", "r1", "r4"], capsys)["evals"]}
    acc = evals[("arith", "accuracy")]
    assert (acc["at"], acc["step_a"], acc["a"], acc["step_b"], acc["b"], acc["difference"]) == (
        "step 0", 0, 0.1, 0, 0.1, 0.0)
    assert acc["verdict"] == "no significant difference"
    assert (evals[("arith", "pass@4")]["at"], evals[("arith", "pass@4")]["difference"]) == ("no common step", None)
    assert main(["compare", "r1", "r4"]) == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    assert ["arith", "pass@4", "no", "common", "step", "0.800", "[0.711,", "0.867]", "n=100", "(step", "12)", "0.200",
            "[0.133,", "0.289]", "n=100", "(step", "0)"] in lines


def test_compare_a_run_without_steps_or_evals(history, capsys):
    c = run_json(["compare", "r3", "r1"], capsys)
    assert c["spec"] == [{"path": "seed", "a": 3, "b": 1}]
    steps = {s["aggregate"]: s for s in c["steps"]}
    assert steps["steps"] == {"aggregate": "steps", "a": 0, "b": 12, "difference": 12}
    assert steps["reward_mean_last10"]["a"] is None and steps["reward_mean_last10"]["difference"] is None


def test_compare_unknown_runs_are_named(history, capsys):
    assert "unknown run id 'nope'" in run_error(["compare", "r1", "nope"], capsys)
    assert "unknown run ids 'x', 'y'" in run_error(["compare", "x", "y"], capsys)
    assert main(["compare", "r1", "r2", "--format", "csv"]) == 2  # no csv form
    assert "invalid choice" in capsys.readouterr().err


def test_spec_flattening_walks_mappings_and_keeps_lists_whole():
    assert flatten_spec('{"a": {"b": 1, "c": {"d": [1, 2]}, "e": {}}, "f": null}') == {
        "a.b": 1, "a.c.d": [1, 2], "a.e": {}, "f": None}
    assert flatten_spec("not json") == {"spec": "not json"}
    assert spec_diff('{"x": 1, "y": true}', '{"x": 1.0, "y": 1}') == [
        {"path": "x", "a": 1, "b": 1.0}, {"path": "y", "a": True, "b": 1}]


def test_runs_lists_the_sweep_of_each_run(history, capsys):
    assert {r["run_id"]: r["sweep_id"] for r in run_json(["runs"], capsys)} == {"r1": "s1", "r2": "s1", "r3": None}


def test_best_defaults_to_the_held_out_split_when_runs_have_more_benchmarks(history, capsys):
    with Lake.open(history) as lake:
        lake.upsert("evals", [dict(run_id=r, step=12, benchmark=b, metric="accuracy", value=v, n=10, recorded_at=T0)
                              for r, b, v in [("r1", "arithmetic_heldout", 0.3), ("r2", "arithmetic_heldout", 0.5),
                                              ("r1", "carry_chains", 0.9)]])
    rows = run_json(["best", "--metric", "accuracy"], capsys)
    assert [(r["run_id"], r["benchmark"]) for r in rows] == [("r2", "arithmetic_heldout"), ("r1", "arithmetic_heldout")]
