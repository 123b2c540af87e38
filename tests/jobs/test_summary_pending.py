"""The sweep summary arrives as soon as the members end, names the evals still pending, and is drawn again as they
land; every sensor says why it skips. Real sensor evaluations on a temp Dagster instance and a real lake.

No training here: a sweep is planned and stored as the `sweep` job would, its members' `sweeps` rows and
checkpoints are written to the lake, runs the daemon would launch are run records (`create_run_for_test`), and an
eval that lands is a materialization of its `checkpoint_eval` partition, which is all the sensors read.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from dagster import (
    AssetMaterialization,
    DagsterInstance,
    DagsterRunStatus,
    MultiPartitionKey,
    build_sensor_context,
    materialize,
)
from dagster._core.test_utils import create_run_for_test

from assets.evals import checkpoints
from assets.sweeps import sweep_members, sweep_summary, sweeps, warm_starts
from factory.config import parse_overrides
from factory.runs.checkpoint_eval import checkpoint_key
from factory.sweep import SweepDefinition, plan_sweep, set_control, write_sweep
from jobs import defs
from jobs._queue import EVAL_TAGS, in_flight
from jobs.evals import new_checkpoint_evals
from jobs.sweeps import sweep_launcher, sweep_summarizer

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
BENCH = ("heldout", "carry_chains")  # an arithmetic run's benchmarks (factory.envs.eval_suites)


@pytest.fixture
def instance(factory_home):
    with DagsterInstance.ephemeral() as inst:
        yield inst


def tick(sensor, instance, cursor=None):
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources) as ctx:
        return sensor(ctx)


def reason(result) -> str | None:
    return result.skip_reason.skip_message if result.skip_reason else None


def plan(instance, factory_home, lrs=(1e-3, 3e-3, 1e-2), max_concurrent=2) -> tuple[str, list[str]]:
    """A sweep stored as the `sweep` job stores it (one warm start shared by the members: they differ in lr)."""
    p = plan_sweep(SweepDefinition(name="t", base_spec=BASE, overrides=parse_overrides(["schedule.steps=2"]),
                                   axes={"algorithm.lr": list(lrs)}, max_concurrent=max_concurrent))
    instance.add_dynamic_partitions(warm_starts.name, list(p.warm_starts()))
    instance.add_dynamic_partitions(sweep_members.name, [m.key for m in p.members])
    instance.add_dynamic_partitions(sweeps.name, [p.sweep_id])
    write_sweep(p, factory_home)
    return p.sweep_id, [m.key for m in p.members]


def members_at(lake, sweep_id: str, keys: list[str], statuses: list[str]) -> None:
    """The members' `sweeps` rows; one that ended has recorded its final checkpoint (step 2) first."""
    for i, (key, status) in enumerate(zip(keys, statuses, strict=True)):
        ended = status not in ("queued", "running")
        if ended:
            lake.upsert("checkpoints", [dict(run_id=f"run-{i}", step=2, kind="rl", uri=f"/ckpt/{i}", bytes=1,
                                             sha256="0" * 64, recorded_at=T0 + timedelta(seconds=i))])
        lake.upsert("sweeps", [dict(sweep_id=sweep_id, member=key, name="t", axes=json.dumps({"i": i}), spec="{}",
                                    status=status, run_id=f"run-{i}" if status != "queued" else None,
                                    final_accuracy=0.5 + 0.01 * i if status == "succeeded" else None,
                                    created_at=T0, recorded_at=T0 + timedelta(seconds=i))])


def eval_lands(instance, partition: str) -> None:
    """An eval's run ends and its partition is materialized (what `checkpoint_eval_job` leaves in the instance)."""
    instance.report_runless_asset_event(AssetMaterialization("checkpoint_eval", partition=partition))


def launched(instance, request, job_name: str):
    """What the daemon does with a request: a run of the job with the request's tags, started."""
    tags = {**request.tags, "dagster/partition": str(request.partition_key)}
    return create_run_for_test(instance, job_name=job_name, tags=tags, status=DagsterRunStatus.STARTED)


def ended(instance, run) -> None:
    instance.delete_run(run.run_id)
    create_run_for_test(instance, job_name=run.job_name, tags=run.tags, status=DagsterRunStatus.SUCCESS)


def test_the_summary_comes_when_members_end_then_again_as_late_evals_land(instance, factory_home, lake):
    sweep_id, keys = plan(instance, factory_home)
    members_at(lake, sweep_id, keys, ["succeeded", "running", "queued"])
    assert reason(tick(sweep_summarizer, instance)) == (
        f"sweep {sweep_id}: 2 of 3 members not ended (1 running, 1 queued)")
    members_at(lake, sweep_id, keys, ["succeeded", "succeeded", "running"])
    assert reason(tick(sweep_summarizer, instance)) == f"sweep {sweep_id}: 1 of 3 members still running"

    # The last member ends with 6 evals owed (3 final checkpoints x 2 benchmarks): the evals leave the only slot
    # (eval limit 1) to the summary, which comes at once, saying what is pending.
    members_at(lake, sweep_id, keys, ["succeeded", "succeeded", "failed"])
    evals = tick(new_checkpoint_evals, instance)
    assert evals.run_requests == []
    assert reason(evals) == (f"eval limit 1: 0 running and 1 slot(s) held for the summary of sweep {sweep_id} "
                             "(it goes first); 6 eval(s) wait")
    for add in evals.dynamic_partitions_requests:
        instance.add_dynamic_partitions(add.partitions_def_name, add.partition_keys)
    first = tick(sweep_summarizer, instance)
    (req,) = first.run_requests
    assert req.partition_key == sweep_id and req.tags["factory/evals_pending"] == "6"
    assert req.tags["factory/queue"] == "eval"  # a summary counts against the eval limit
    summary = launched(instance, req, "sweep_summary_job")
    assert reason(tick(sweep_summarizer, instance, first.cursor)) == (
        f"sweep {sweep_id}: summary up to date (6 eval(s) pending)")
    assert reason(tick(new_checkpoint_evals, instance)) == "eval limit 1 reached: 1 running; 6 eval(s) wait"
    ended(instance, summary)

    # The evals run one at a time; a summary between them would only delay them, so none is drawn until every
    # owed eval has started; then the one that is due waits for the slot, and the complete one comes last.
    requests = [req]
    owed = [str(MultiPartitionKey({"checkpoint": checkpoint_key(f"run-{i}", 2), "benchmark": b}))
            for i in range(3) for b in BENCH]
    for n in range(6):
        (ev,) = tick(new_checkpoint_evals, instance).run_requests
        assert str(ev.partition_key) in owed
        run = launched(instance, ev, "checkpoint_eval_job")
        assert in_flight(instance, EVAL_TAGS) == 1  # never more than the limit
        res = tick(sweep_summarizer, instance, first.cursor)
        requests += res.run_requests
        assert res.run_requests == []
        expected = (f"sweep {sweep_id}: summary up to date (6 eval(s) pending)" if n == 0 else
                    f"sweep {sweep_id}: the summary is drawn again once its {5 - n} owed eval(s) not started yet "
                    f"have started ({6 - n} eval(s) pending)" if n < 5 else
                    f"sweep {sweep_id}: summary due again, 1 eval(s) pending; it waits for an eval slot (eval limit 1 "
                    "reached: 1 running)")
        assert reason(res) == expected
        ended(instance, run)
        eval_lands(instance, str(ev.partition_key))
    assert reason(tick(new_checkpoint_evals, instance)) == "no checkpoint owes an eval"
    final = tick(sweep_summarizer, instance, first.cursor)
    (last,) = final.run_requests
    assert last.tags["factory/evals_pending"] == "0" and last.run_key != req.run_key
    assert json.loads(final.cursor) == [sweep_id]  # complete: nothing more to do for this sweep
    ended(instance, launched(instance, last, "sweep_summary_job"))
    assert reason(tick(sweep_summarizer, instance, final.cursor)) == "every sweep is summarized with every eval"
    assert reason(tick(sweep_summarizer, instance)) == "every sweep is summarized with every eval"  # cursor lost


def test_a_summary_in_between_comes_when_every_owed_eval_has_started(instance, factory_home, lake):
    """Evals that failed are owed but not started again until eval_schedule retries them: the summary is drawn
    again with them pending instead of waiting for the retry."""
    sweep_id, keys = plan(instance, factory_home, lrs=(1e-3,))
    members_at(lake, sweep_id, keys, ["succeeded"])
    first = tick(sweep_summarizer, instance)
    ended(instance, launched(instance, first.run_requests[0], "sweep_summary_job"))
    instance.add_dynamic_partitions(checkpoints.name, [checkpoint_key("run-0", 2)])
    (failing,) = tick(new_checkpoint_evals, instance).run_requests
    run = launched(instance, failing, "checkpoint_eval_job")
    instance.delete_run(run.run_id)
    create_run_for_test(instance, job_name=run.job_name, tags=run.tags, status=DagsterRunStatus.FAILURE)
    (ev,) = tick(new_checkpoint_evals, instance).run_requests
    assert ev.partition_key != failing.partition_key
    ended(instance, launched(instance, ev, "checkpoint_eval_job"))
    eval_lands(instance, str(ev.partition_key))
    assert reason(tick(new_checkpoint_evals, instance)).startswith(
        "1 eval(s) owed, every one launched (0 running, 1 failed or canceled: eval_schedule retries those")
    (again,) = tick(sweep_summarizer, instance, first.cursor).run_requests
    assert again.tags["factory/evals_pending"] == "1" and again.run_key != first.run_requests[0].run_key


def test_the_summary_says_which_evals_are_pending_and_its_version_is_the_evals_done(instance, factory_home, lake):
    sweep_id, keys = plan(instance, factory_home, lrs=(1e-3, 3e-3))
    members_at(lake, sweep_id, keys, ["succeeded", "succeeded"])
    instance.add_dynamic_partitions(checkpoints.name, [checkpoint_key(f"run-{i}", 2) for i in range(2)])
    eval_lands(instance, str(MultiPartitionKey({"checkpoint": "run-0@2", "benchmark": "heldout"})))

    def summarize():
        result = materialize([sweep_summary], partition_key=sweep_id, instance=instance, resources=defs.resources)
        (mat,) = result.asset_materializations_for_node("sweep_summary")
        return mat.metadata, mat.tags["dagster/data_version"]

    md, version = summarize()
    assert md["pending_evals"].value == ("3: run-0@2 x carry_chains, run-1@2 x heldout, run-1@2 x carry_chains")
    assert md["pending_evals_count"].value == 3
    for i in range(2):
        for b in BENCH:
            eval_lands(instance, str(MultiPartitionKey({"checkpoint": f"run-{i}@2", "benchmark": b})))
    md2, version2 = summarize()
    assert md2["pending_evals"].value == "none" and version2 != version
    assert summarize()[1] == version2  # the same evals done, the same version


def test_the_launcher_says_why_it_starts_nothing(instance, factory_home):
    assert reason(tick(sweep_launcher, instance)) == "no sweep has members left to start"
    sweep_id, keys = plan(instance, factory_home)
    first = tick(sweep_launcher, instance)
    (ws,) = first.run_requests
    warm = launched(instance, ws, "sweep_warm_start_job")
    assert reason(tick(sweep_launcher, instance, first.cursor)) == (
        f"sweep {sweep_id}: waiting for warm start {ws.partition_key}")
    ended(instance, warm)
    instance.report_runless_asset_event(AssetMaterialization("sweep_warm_start", partition=ws.partition_key))
    second = tick(sweep_launcher, instance, first.cursor)
    assert [r.partition_key for r in second.run_requests] == keys[:2]
    runs = [launched(instance, r, "sweep_member_job") for r in second.run_requests]
    assert reason(tick(sweep_launcher, instance, second.cursor)) == (
        f"sweep {sweep_id}: max_concurrent 2 reached: 2 running")
    set_control(factory_home, sweep_id, paused=True)
    ended(instance, runs[0])
    assert reason(tick(sweep_launcher, instance, second.cursor)) == f"sweep {sweep_id} paused"
    set_control(factory_home, sweep_id, paused=False)
    third = tick(sweep_launcher, instance, second.cursor)
    assert [r.partition_key for r in third.run_requests] == keys[2:]
    assert reason(tick(sweep_launcher, instance, third.cursor)) == "no sweep has members left to start"


def test_no_slot_is_held_for_a_summarizer_that_is_turned_off(factory_home, lake):
    """With `sweep_summarizer` stopped (Automation, in a real instance's schedule storage) nothing would take the
    held slot: the evals go on instead of waiting for it forever."""
    from dagster import instance_for_test
    from dagster._core.remote_origin import (
        RegisteredCodeLocationOrigin,
        RemoteInstigatorOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.scheduler.instigation import InstigatorState, InstigatorStatus, InstigatorType

    with instance_for_test() as instance:
        sweep_id, keys = plan(instance, factory_home, lrs=(1e-3,))
        members_at(lake, sweep_id, keys, ["succeeded"])
        assert tick(new_checkpoint_evals, instance).run_requests == []  # held for the summary
        origin = RemoteInstigatorOrigin(RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("factory"),
                                                               "__repository__"), "sweep_summarizer")
        instance.add_instigator_state(InstigatorState(origin, InstigatorType.SENSOR, InstigatorStatus.STOPPED))
        (ev,) = tick(new_checkpoint_evals, instance).run_requests
        assert ev.tags["factory/checkpoint"] == checkpoint_key("run-0", 2)


def test_a_sweep_that_cannot_be_read_holds_back_neither_other_sweeps_nor_evals(instance, factory_home, lake):
    sweep_id, keys = plan(instance, factory_home, lrs=(1e-3,))
    members_at(lake, sweep_id, keys, ["succeeded"])
    broken = factory_home.root / "sweeps" / "t-broken"
    broken.mkdir()
    (broken / "sweep.json").write_text("{not json")
    res = tick(sweep_summarizer, instance)
    assert [r.partition_key for r in res.run_requests] == [sweep_id]
    ended(instance, launched(instance, res.run_requests[0], "sweep_summary_job"))
    assert "; sweep t-broken: its sweep.json cannot be read (JSONDecodeError: " in reason(
        tick(sweep_summarizer, instance, res.cursor))
    (ev,) = tick(new_checkpoint_evals, instance).run_requests
    assert ev.tags["factory/checkpoint"] == checkpoint_key("run-0", 2)
