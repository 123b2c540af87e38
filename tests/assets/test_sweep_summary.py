"""assets/sweeps.py sweep_summary on a tpe sweep with a pruned member (issue 32, points 7 and 10): the best member,
its accuracy and the ranking agree with each other and with `factory best`, final results only (the pruned member's
better accuracy at an earlier step is listed, not ranked, and `ranked_by` says so); a lone finished member gets a
verdict that says so; the sweep's MLflow parent run ends with the summary and counts its members.

A real Dagster materialization of the asset (temp instance), a real lake and MLflow store; the members' rows, runs
and evals are written as their runs leave them."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from dagster import DagsterInstance, materialize

from assets.sweeps import sweep_summary, sweeps
from factory.cli import main
from factory.cockpit.tracking import Tracker
from jobs import defs

T0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
N = 500


@pytest.fixture
def instance(factory_home):
    with DagsterInstance.ephemeral() as inst:
        yield inst


def member(lake, sweep_id: str, i: int, lr: float, status: str, at: dict[int, float], parent: str) -> None:
    """Member m00<i>: its `sweeps` row and `runs` row as its run leaves them, its held-out evals by step, and a
    pass@4 at step 0 (the SFT start) and, when it finished, at its last step."""
    run_id = f"{sweep_id}-m00{i}-run"
    last = max(at)
    lake.upsert("sweeps", [dict(sweep_id=sweep_id, member=f"{sweep_id}-m00{i}-lr={lr}", name="tpe",
                                axes=json.dumps({"algorithm.lr": lr}), spec="{}", status=status, run_id=run_id,
                                final_accuracy=at[last] if status == "succeeded" else None,
                                mlflow_parent_run_id=parent, created_at=T0, recorded_at=T0)])
    lake.upsert("runs", [dict(run_id=run_id, sweep_id=sweep_id, name=f"tpe-m00{i}", spec="{}", spec_fingerprint="f",
                              code_version="c", seed=0, status=status, started_at=T0)])
    ev = dict(run_id=run_id, benchmark="arithmetic_heldout", n=N, recorded_at=T0)
    lake.upsert("evals", [dict(ev, step=s, metric="accuracy", value=v) for s, v in at.items()]
                + [dict(ev, step=0, metric="pass@4", value=0.9)]
                + ([dict(ev, step=last, metric="pass@4", value=0.8)] if status == "succeeded" else []))


def summarize(instance, sweep_id: str):
    instance.add_dynamic_partitions(sweeps.name, [sweep_id])
    result = materialize([sweep_summary], partition_key=sweep_id, instance=instance, resources=defs.resources)
    (mat,) = result.asset_materializations_for_node("sweep_summary")
    return {k: v.value for k, v in mat.metadata.items()}


def best(argv: list[str], capsys) -> list[dict]:
    assert main(["best", *argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_best_member_its_accuracy_and_the_ranking_agree_with_factory_best(instance, factory_home, lake, capsys):
    parent = Tracker(factory_home).start_run("tpe", "t1")
    # m001 was pruned at step 30 with a held-out accuracy above m000's final one at step 40 (the issue's figures)
    member(lake, "t1", 0, 1e-4, "succeeded", {0: 0.5, 30: 0.62, 40: 0.642}, parent)
    member(lake, "t1", 1, 3e-4, "pruned", {0: 0.5, 30: 0.674}, parent)
    member(lake, "t1", 2, 1e-3, "succeeded", {0: 0.5, 30: 0.5, 40: 0.56}, parent)

    md = summarize(instance, "t1")
    assert md["best_member"] == "t1-m000-lr=0.0001"  # before: m000 named, with m001's 0.674 as its accuracy
    assert (md["best_accuracy"], md["best_accuracy_ci95"]) == (0.642, "0.642 [0.599, 0.683] n=500")
    assert md["ranked_by"] == ("final held-out accuracy (arithmetic_heldout) of the 2 succeeded members, each at its "
                               "final evaluated step (40); not ranked (no final result): m001 pruned at step 30")
    table = [(r.data["rank"], r.data["member"].split()[0], r.data["status"].split(",")[0],
              r.data["accuracy"].split()[0]) for r in md["members_table"].records]
    assert table == [(1, "m000", "succeeded", "0.642"), (2, "m002", "succeeded", "0.560"),
                     (None, "m001", "pruned", "0.674")]
    assert md["verdict"].startswith("m000 (lr=1e-4) wins (diff +0.082 [")
    assert (md["members"], md["succeeded"], md["pruned"], md["failed"]) == (3, 2, 1, 0)

    # `factory best` ranks the same members the same way, on the same final results
    ranked = best(["--metric", "accuracy", "--sweep", "t1"], capsys)
    assert [(r["run_id"], r["value"], r["ci95"]) for r in ranked] == [("t1-m000-run", 0.642, "[0.599, 0.683]"),
                                                                      ("t1-m002-run", 0.56, "[0.516, 0.603]")]
    # and does not rank the pruned member by its step-0 pass@4 (the SFT start)
    assert [r["run_id"] for r in best(["--metric", "pass@4", "--sweep", "t1"], capsys)] == ["t1-m000-run",
                                                                                             "t1-m002-run"]


def test_a_lone_finished_member_gets_a_verdict_that_says_so(instance, factory_home, lake):
    parent = Tracker(factory_home).start_run("tpe", "t2")
    member(lake, "t2", 0, 1e-4, "succeeded", {0: 0.5, 40: 0.6}, parent)
    member(lake, "t2", 1, 3e-4, "pruned", {0: 0.5, 20: 0.3}, parent)
    md = summarize(instance, "t2")
    assert md["best_member"] == "t2-m000-lr=0.0001"
    assert md["verdict"] == "m000 (lr=1e-4) is the only member with a final result: nothing to compare it with"


def test_the_sweeps_mlflow_parent_run_ends_with_its_summary_and_counts_its_members(instance, factory_home, lake):
    """Issue 32: the parent stayed RUNNING forever, and a tpe sweep's said `members: 0` (it has none at launch)."""
    tracker = Tracker(factory_home)
    parent = tracker.start_run("tpe", "t3", tags={"factory.sweep_id": "t3", "factory.members": 0, "factory.trials": 2})
    member(lake, "t3", 0, 1e-4, "succeeded", {0: 0.5, 40: 0.6}, parent)
    member(lake, "t3", 1, 3e-4, "pruned", {0: 0.5, 20: 0.3}, parent)
    summarize(instance, "t3")
    run = tracker.get_run(parent)
    assert run.info.status == "FINISHED"
    assert {k: run.data.tags[f"factory.{k}"] for k in ("members", "succeeded", "pruned", "failed")} == {
        "members": "2", "succeeded": "1", "pruned": "1", "failed": "0"}
