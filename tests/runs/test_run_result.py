"""factory/runs/run_result.py: a run's recorded result and headline are its result as lake/results.py defines it,
accuracy on its own task's held-out set at the final evaluated step, with its baseline at step 0; for a run whose
prompts come from one blend source (the SmolLM2 example's chain_sum) that is the source's held-out set, and the run
report, `factory runs`, `factory best` and MLflow all headline it."""

from __future__ import annotations

import datetime as dt
import json

from mlflow.tracking import MlflowClient

from factory.cli import main
from factory.cockpit.tracking import Tracker
from factory.runs.run_result import finished_result, headline, headline_accuracy, tell_mlflow
from factory.runs.stages import eval_summary, render_report

T0 = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
HELD = "arithmetic_heldout"


def _succeeded(lake, tmp_path, run_id: str) -> None:
    ckpt = tmp_path / run_id / "final"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"weights")
    lake.upsert("runs", [dict(run_id=run_id, name=run_id, status="succeeded", spec="{}", spec_fingerprint="f",
                              code_version="c", seed=0, started_at=T0, final_checkpoint=str(ckpt))])


def test_a_finished_runs_result_is_its_held_out_accuracy_at_the_final_step(lake, tmp_path):
    _succeeded(lake, tmp_path, "q")
    ev = dict(run_id="q", n=500, recorded_at=T0)
    lake.upsert("evals", [dict(ev, step=0, benchmark=HELD, metric="accuracy", value=0.744),
                          dict(ev, step=60, benchmark=HELD, metric="accuracy", value=0.764),
                          dict(ev, step=60, benchmark=HELD, metric="sft_control_accuracy", value=0.9),
                          dict(ev, step=60, benchmark="carry_chains", metric="accuracy", value=0.8, n=200)])
    res = finished_result(lake, "q")
    assert (res.steps, res.start_accuracy, res.final_accuracy, res.benchmark) == (60, 0.744, 0.764, HELD)


# The SmolLM2 example (issue 32): trained on reasoning-gym chain_sum prompts; 0.000 on the arithmetic task's held-out
# split at every step, 0.46 -> 0.58 on chain_sum's own held-out set.
SMOLLM2 = [(step, bench, value) for step, chain_sum in ((0, 0.46), (2, 0.5), (4, 0.58))
           for bench, value in ((HELD, 0.0), ("source:chain_sum", chain_sum))]


def test_a_run_on_one_blend_source_is_headlined_by_that_sources_held_out_set(lake, tmp_path, capsys):
    _succeeded(lake, tmp_path, "smol")
    lake.upsert("evals", [dict(run_id="smol", step=s, benchmark=b, metric="accuracy", value=v, n=50, recorded_at=T0)
                          for s, b, v in SMOLLM2]
                + [dict(run_id="smol", step=0, benchmark=HELD, metric="pass@1", value=0.02, n=50, recorded_at=T0)])

    h = headline(lake, "smol")
    assert (h.benchmark, h.outcome.start.value, h.outcome.accuracy, h.outcome.step) == ("source:chain_sum", 0.46,
                                                                                       0.58, 4)
    assert h.curve == {0: 0.46, 2: 0.5, 4: 0.58} and h.start_pass_at_k is None  # no pass@k on chain_sum
    assert h.outcome.text() == ("source:chain_sum 0.580 [0.442, 0.706] n=50 at step 4, from 0.460 [0.330, 0.596] "
                                "n=50 at step 0 (arithmetic_heldout 0.000 [0.000, 0.071] n=50)")
    res = finished_result(lake, "smol")
    assert (res.benchmark, res.start_accuracy, res.final_accuracy, res.start_pass_at_k) == (
        "source:chain_sum", 0.46, 0.58, None)

    report = render_report(eval_summary(lake, "smol"))  # what `factory run` prints and the eval_report asset shows
    lines = report.splitlines()
    assert lines[0] == "### Run `smol` — held-out accuracy (source:chain_sum, 95% Wilson intervals)"
    assert lines[2:6] == ["| checkpoint | greedy accuracy |", "|---|---|",  # no pass@k on chain_sum: no column
                          "| SFT warm start (step 0) | 0.460 [0.330, 0.596] n=50 |",
                          "| GRPO (step 4) | 0.580 [0.442, 0.706] n=50 |"]
    assert ("Other benchmarks, step 0 → step 4: arithmetic_heldout 0.000 [0.000, 0.071] n=50 → 0.000 [0.000, "
            "0.071] n=50") in report

    assert main(["runs", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["benchmark"], row["accuracy"], row["n"], row["start_accuracy"], row["start_ci95"]) == (
        "source:chain_sum", 0.58, 50, 0.46, "[0.330, 0.596]")
    assert main(["best", "--metric", "accuracy", "--format", "json"]) == 0
    (best,) = json.loads(capsys.readouterr().out)
    assert (best["benchmark"], best["value"]) == ("source:chain_sum", 0.58)


def test_the_headline_reaches_mlflow_with_its_baseline(lake, factory_home):
    lake.upsert("evals", [dict(run_id="smol", step=s, benchmark=b, metric="accuracy", value=v, n=50, recorded_at=T0)
                          for s, b, v in SMOLLM2])
    tracker = Tracker(factory_home)
    mlflow_id = tracker.start_run("smollm2_reasoning", "smol")
    tell_mlflow(tracker, mlflow_id, headline(lake, "smol"))
    client = MlflowClient(tracking_uri=f"sqlite:///{factory_home.mlflow_db}")
    assert client.get_run(mlflow_id).data.tags["factory.headline_benchmark"] == "source:chain_sum"
    points = sorted((m.step, m.value) for m in client.get_metric_history(mlflow_id, "headline/accuracy"))
    assert points == [(0, 0.46), (2, 0.5), (4, 0.58)]


def test_a_periodic_eval_tells_a_sweeps_pruner_the_headline():
    # What `on_eval` (a tpe sweep's pruner) is told after a periodic eval: the run's own task's held-out accuracy.
    assert headline_accuracy(0.0, {"chain_sum": 0.5}) == 0.5  # the SmolLM2 example: chain_sum, not arithmetic
    assert headline_accuracy(0.3, {"add2": 0.1, "add3": 0.2}) == 0.3  # a blend of several: the task's split
    assert headline_accuracy(0.3, {}) == 0.3  # no data section
