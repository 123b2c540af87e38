"""A member whose run worker was killed keeps its sweep slot until Dagster's retry of it exists (issue 32, point 3):
with `max_concurrent: 1` the launcher starts nothing beside the failed run awaiting its retry, nor beside the retry,
and a tpe sweep asks its next trial only once the study has the killed member's result.

Real sensor evaluations on a temp Dagster instance with run retries on (as `make ui` sets them), a real Optuna study
and lake. The runs the daemon would launch are run records (`create_run_for_test`) with the member job's tags, the
kill is the run failure Dagster records for it (its `dagster/will_retry` tag written by the instance), and the retry
is a run of the same group as Dagster's auto re-execution creates it (the whole path through a code server and a
killed worker is `benchmarks/sweep_kill.py`)."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
from dagster import AssetMaterialization, DagsterRunStatus, build_sensor_context
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, RETRY_NUMBER_TAG, WILL_RETRY_TAG
from dagster._core.test_utils import create_run_for_test, instance_for_test
from dagster._daemon.types import DaemonHeartbeat

from assets._retries import TRAINING_TAGS
from assets.sweeps import sweep_members, sweeps, warm_starts
from factory.cockpit.sweep import SweepDefinition, plan_sweep, read_sweep, write_sweep
from factory.cockpit.tracking import Tracker
from factory.config import parse_overrides
from factory.lake import Lake
from jobs import defs
from jobs._queue import awaiting_retry, holds_slot
from jobs.sweeps import sweep_launcher
from resources.study import sweep_study

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
SPACE = {"algorithm.lr": {"low": 1.0e-4, "high": 1.0e-3, "log": True}}


@pytest.fixture
def instance(factory_home):
    with instance_for_test(overrides={"run_retries": {"enabled": True}}) as inst:
        inst.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "SENSOR", None, []))
        yield inst


def tick(instance, cursor=None):
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources) as ctx:
        return sensor_result(sweep_launcher(ctx))


def sensor_result(result):
    result.skip = result.skip_reason.skip_message if result.skip_reason else None
    return result


def plan_tpe(instance, factory_home, trials: int = 3, parent: str | None = None) -> str:
    """A tpe sweep stored as the `sweep` job stores it: no members yet, its study created (and its MLflow parent
    run `parent`)."""
    defn = SweepDefinition(name="kill", base_spec=BASE, overrides=parse_overrides(["schedule.steps=2"]), mode="tpe",
                           space=SPACE, trials=trials, max_concurrent=1)
    plan = plan_sweep(defn)
    search = {"steps": 2, "eval_every": None}
    sweep_study(instance, factory_home, {"sweep_id": plan.sweep_id, "definition": defn.model_dump(mode="json"),
                                         "search": search})
    instance.add_dynamic_partitions(sweeps.name, [plan.sweep_id])
    write_sweep(plan, factory_home, extra={"search": search, "mlflow_parent_run_id": parent})
    return plan.sweep_id


def start(instance, request, **kw):
    """The run the daemon launches for a request: the member job's tags (its run retries) and the request's."""
    return create_run_for_test(instance, job_name=request.job_name, tags={**TRAINING_TAGS, **request.tags},
                               status=DagsterRunStatus.STARTED, **kw)


def first_member(instance, factory_home, parent: str | None = None):
    """The sweep's first trial started, its warm start done: (sweep_id, its run, the request, the cursor)."""
    sweep_id = plan_tpe(instance, factory_home, parent=parent)
    first = tick(instance)
    (ws,) = first.run_requests
    instance.report_runless_asset_event(AssetMaterialization("sweep_warm_start", partition=ws.partition_key))
    second = tick(instance, first.cursor)
    (member,) = second.run_requests
    return sweep_id, start(instance, member), member, second.cursor


def trials(instance, factory_home, sweep_id):
    return sweep_study(instance, factory_home, read_sweep(factory_home, sweep_id)).get_trials()


def test_a_killed_member_awaiting_its_retry_holds_its_slot_and_tpe_waits_for_its_result(instance, factory_home):
    sweep_id, run, member, cursor = first_member(instance, factory_home)
    assert [t.state for t in trials(instance, factory_home, sweep_id)] == [optuna.trial.TrialState.RUNNING]

    # The run worker is killed: Dagster records the run failed, and the instance marks it to be retried.
    instance.report_run_failed(instance.get_run_by_id(run.run_id))
    killed = instance.get_run_by_id(run.run_id)
    assert killed.status == DagsterRunStatus.FAILURE and killed.tags[WILL_RETRY_TAG] == "true"
    assert awaiting_retry(instance, killed) and holds_slot(instance, killed)
    after_kill = tick(instance, cursor)
    assert after_kill.run_requests == []  # before the fix: trial 1 was asked and its member started beside the retry
    assert len(trials(instance, factory_home, sweep_id)) == 1
    assert after_kill.skip == (f"sweep {sweep_id}: max_concurrent 1 reached: 1 running (1 failed, awaiting "
                               f"Dagster's retry: {member.partition_key})")

    # Dagster's auto re-execution creates the retry (same group, the parent's tags): still one member in flight.
    retry = create_run_for_test(instance, job_name=member.job_name, status=DagsterRunStatus.NOT_STARTED,
                                tags={**killed.tags, RETRY_NUMBER_TAG: "1"}, root_run_id=run.run_id,
                                parent_run_id=run.run_id)
    instance.add_run_tags(run.run_id, {AUTO_RETRY_RUN_ID_TAG: retry.run_id})
    assert not awaiting_retry(instance, instance.get_run_by_id(run.run_id))
    assert tick(instance, cursor).run_requests == []

    # The retry finishes the member and tells the study its result: only now is the next trial asked.
    study = sweep_study(instance, factory_home, read_sweep(factory_home, sweep_id))
    study.tell(0, 0.5)
    instance.delete_run(retry.run_id)
    create_run_for_test(instance, job_name=member.job_name, status=DagsterRunStatus.SUCCESS,
                        tags={**killed.tags, RETRY_NUMBER_TAG: "1"}, root_run_id=run.run_id, parent_run_id=run.run_id)
    (nxt,) = tick(instance, cursor).run_requests
    assert nxt.partition_key.startswith(f"{sweep_id}-m001-lr=")
    states = [t.state for t in trials(instance, factory_home, sweep_id)]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING]


def test_a_failed_run_before_its_will_retry_tag_is_written_already_holds_its_slot(instance, factory_home):
    """The failure is stored a moment before the instance tags it: the retry policy decides meanwhile."""
    sweep_id, run, member, cursor = first_member(instance, factory_home)
    instance.delete_run(run.run_id)
    bare = create_run_for_test(instance, job_name=member.job_name, status=DagsterRunStatus.FAILURE,
                               tags={**TRAINING_TAGS, **member.tags})
    assert WILL_RETRY_TAG not in bare.tags and awaiting_retry(instance, bare)
    assert tick(instance, cursor).run_requests == []
    assert len(trials(instance, factory_home, sweep_id)) == 1


def test_a_member_whose_retries_are_spent_has_its_trial_failed_before_the_next_is_asked(instance, factory_home):
    tracker = Tracker(factory_home)
    parent = tracker.start_run("kill", "tpe", tags={"factory.members": 0, "factory.trials": 3})
    sweep_id, run, member, cursor = first_member(instance, factory_home, parent=parent)
    assert tracker.get_run(parent).data.tags["factory.members"] == "1"  # the parent counts trials as they are asked
    instance.delete_run(run.run_id)
    spent = create_run_for_test(instance, job_name=member.job_name, status=DagsterRunStatus.FAILURE,
                                tags={**TRAINING_TAGS, **member.tags, WILL_RETRY_TAG: "false"})
    assert not holds_slot(instance, spent)
    with Lake.open(factory_home) as lake:  # the member's own row, as run_sweep_member leaves a failed one
        (row,) = lake.read("sweeps").to_pylist()
        lake.upsert("sweeps", [dict(row, status="failed")])
    (nxt,) = tick(instance, cursor).run_requests
    assert nxt.partition_key.startswith(f"{sweep_id}-m001-lr=")
    states = [t.state for t in trials(instance, factory_home, sweep_id)]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.RUNNING]
    assert instance.get_dynamic_partitions(sweep_members.name)[0] == member.partition_key
    assert tracker.get_run(parent).data.tags["factory.members"] == "2"
    assert len(instance.get_dynamic_partitions(warm_starts.name)) == 1
