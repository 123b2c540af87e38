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
    build_sensor_context,
    materialize,
)
from dagster._core.storage.tags import WILL_RETRY_TAG
from dagster._core.test_utils import create_run_for_test

from assets.evals import checkpoint_evals
from assets.sweeps import sweep_members, sweep_summary, sweeps, warm_starts
from factory.cockpit.sweep import MEMBER_TAG, SWEEP_TAG, SweepDefinition, plan_sweep, set_control, write_sweep
from factory.config import parse_overrides
from factory.runs.checkpoint_eval import checkpoint_key, eval_key
from jobs import defs
from jobs._queue import EVAL_TAGS, SUMMARY_TAGS, in_flight
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


def members_at(lake, sweep_id: str, keys: list[str], statuses: list[str], runs: str = "run") -> None:
    """The members' `sweeps` rows (their runs `<runs>-<i>`); one that ended has recorded its final checkpoint (step
    2) first."""
    for i, (key, status) in enumerate(zip(keys, statuses, strict=True)):
        ended = status not in ("queued", "running")
        if ended:
            lake.upsert("checkpoints", [dict(run_id=f"{runs}-{i}", step=2, kind="rl", uri=f"/ckpt/{i}", bytes=1,
                                             sha256="0" * 64, recorded_at=T0 + timedelta(seconds=i))])
        lake.upsert("sweeps", [dict(sweep_id=sweep_id, member=key, name="t", axes=json.dumps({"i": i}), spec="{}",
                                    status=status, run_id=f"{runs}-{i}" if status != "queued" else None,
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

    # An eval of an ended member's checkpoint is running (the eval limit, 1, is reached) when the last member ends.
    evals = tick(new_checkpoint_evals, instance)
    for add in evals.dynamic_partitions_requests:
        instance.add_dynamic_partitions(add.partitions_def_name, add.partition_keys)
    (ev,) = evals.run_requests
    busy = launched(instance, ev, "checkpoint_eval_job")
    members_at(lake, sweep_id, keys, ["succeeded", "succeeded", "failed"])
    evals = tick(new_checkpoint_evals, instance)
    assert evals.run_requests == [] and reason(evals) == "eval limit 1 reached: 1 running; 5 eval(s) wait"
    for add in evals.dynamic_partitions_requests:
        instance.add_dynamic_partitions(add.partitions_def_name, add.partition_keys)

    # The first summary is requested on the first tick after the last member ends, beside the running eval: it has
    # a queue of its own, and names the 6 evals not landed (3 final checkpoints x 2 benchmarks).
    first = tick(sweep_summarizer, instance)
    (req,) = first.run_requests
    assert req.partition_key == sweep_id and req.tags["factory/evals_pending"] == "6"
    assert req.tags["factory/queue"] == "summary" and in_flight(instance, EVAL_TAGS) == 1
    summary = launched(instance, req, "sweep_summary_job")
    assert reason(tick(sweep_summarizer, instance, first.cursor)) == (
        f"sweep {sweep_id}: summary up to date (6 eval(s) pending)")

    # The eval ends and lands; the next one starts while the summary is being drawn: evals do not wait for it.
    ended(instance, busy)
    eval_lands(instance, str(ev.partition_key))
    (ev,) = tick(new_checkpoint_evals, instance).run_requests
    assert in_flight(instance, SUMMARY_TAGS) == 1
    run = launched(instance, ev, "checkpoint_eval_job")
    assert reason(tick(sweep_summarizer, instance, first.cursor)) == (
        f"sweep {sweep_id}: a summary is being drawn; the next one (5 eval(s) pending) follows when it ends")
    ended(instance, summary)

    # The evals go on one at a time; a summary in between is drawn only once every owed eval has started (not
    # after each eval), then beside the last eval; the complete one once every eval has landed.
    owed = [eval_key(checkpoint_key(f"run-{i}", 2), b) for i in range(3) for b in BENCH]
    seen, between, between_req = [], None, None
    for n in range(5):
        assert str(ev.partition_key) in owed and in_flight(instance, EVAL_TAGS) == 1  # never more than the limit
        seen.append(str(ev.partition_key))
        res = tick(sweep_summarizer, instance, first.cursor)
        if n < 4:
            assert res.run_requests == []
            assert reason(res) == (f"sweep {sweep_id}: the summary is drawn again once its {4 - n} owed eval(s) not "
                                   f"started yet have started ({5 - n} eval(s) pending)")
        else:
            (between_req,) = res.run_requests
            assert between_req.tags["factory/evals_pending"] == "1" and in_flight(instance, EVAL_TAGS) == 1
            between = launched(instance, between_req, "sweep_summary_job")
        ended(instance, run)
        eval_lands(instance, str(ev.partition_key))
        if n < 4:
            (ev,) = tick(new_checkpoint_evals, instance).run_requests
            run = launched(instance, ev, "checkpoint_eval_job")
    assert len(set(seen)) == 5
    assert reason(tick(new_checkpoint_evals, instance)) == "no checkpoint owes an eval"
    # Never two summaries in flight: the complete one follows the one in between.
    assert reason(tick(sweep_summarizer, instance, first.cursor)) == (
        f"sweep {sweep_id}: a summary is being drawn; the next one (no eval pending) follows when it ends")
    ended(instance, between)
    final = tick(sweep_summarizer, instance, first.cursor)
    (last,) = final.run_requests
    assert last.tags["factory/evals_pending"] == "0" and last.run_key not in (req.run_key, between_req.run_key)
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
    instance.add_dynamic_partitions(checkpoint_evals.name, [eval_key(checkpoint_key("run-0", 2), b) for b in BENCH])
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
    instance.add_dynamic_partitions(checkpoint_evals.name, [eval_key(f"run-{i}@2", b) for i in range(2) for b in BENCH])
    eval_lands(instance, eval_key("run-0@2", "heldout"))

    def summarize():
        result = materialize([sweep_summary], partition_key=sweep_id, instance=instance, resources=defs.resources)
        (mat,) = result.asset_materializations_for_node("sweep_summary")
        return mat.metadata, mat.tags["dagster/data_version"]

    md, version = summarize()
    assert md["pending_evals"].value == ("3: run-0@2 x carry_chains, run-1@2 x heldout, run-1@2 x carry_chains")
    assert md["pending_evals_count"].value == 3
    for i in range(2):
        for b in BENCH:
            eval_lands(instance, eval_key(f"run-{i}@2", b))
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


def test_never_two_summaries_at_once_whatever_evals_run(instance, factory_home, lake):
    """Two sweeps end together: one summary is drawn, the other waits for it, saying so; an eval running changes
    neither."""
    a, keys_a = plan(instance, factory_home, lrs=(1e-3,))
    b, keys_b = plan(instance, factory_home, lrs=(3e-3,))
    members_at(lake, a, keys_a, ["succeeded"], runs="a")
    members_at(lake, b, keys_b, ["succeeded"], runs="b")
    evals = tick(new_checkpoint_evals, instance)
    for add in evals.dynamic_partitions_requests:
        instance.add_dynamic_partitions(add.partitions_def_name, add.partition_keys)
    (ev,) = evals.run_requests  # the summaries due hold no eval slot
    launched(instance, ev, "checkpoint_eval_job")
    first = tick(sweep_summarizer, instance)
    (req,) = first.run_requests
    one, other = sorted([a, b])
    assert req.partition_key == one
    summary = launched(instance, req, "sweep_summary_job")
    assert reason(tick(sweep_summarizer, instance, first.cursor)) == (
        f"sweep {other}: summary due, 2 eval(s) pending; it waits: a summary is being drawn (summary limit 1: 1 "
        f"running); sweep {one}: summary up to date (2 eval(s) pending)")
    ended(instance, summary)
    (nxt,) = tick(sweep_summarizer, instance, first.cursor).run_requests
    assert nxt.partition_key == other and in_flight(instance, EVAL_TAGS) == 1


def test_evals_are_not_held_back_by_a_due_summary(instance, factory_home, lake):
    """A sweep has ended and its summary is due, not requested yet: its evals start anyway (a summary has its own
    queue, so no eval slot is kept for it)."""
    sweep_id, keys = plan(instance, factory_home, lrs=(1e-3,))
    members_at(lake, sweep_id, keys, ["succeeded"])
    instance.add_dynamic_partitions(checkpoint_evals.name, [eval_key(checkpoint_key("run-0", 2), b) for b in BENCH])
    (ev,) = tick(new_checkpoint_evals, instance).run_requests
    assert ev.tags["factory/checkpoint"] == checkpoint_key("run-0", 2)
    launched(instance, ev, "checkpoint_eval_job")
    (req,) = tick(sweep_summarizer, instance).run_requests
    assert req.tags["factory/evals_pending"] == "2"


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


def test_an_interrupted_member_ends_the_sweep_only_once_no_retry_will_resume_it(instance, factory_home, lake):
    """Issue 32: a member whose run worker was killed is `interrupted` (stopped at a resume point), not failed: the
    summary waits while Dagster's retry will resume it, and comes once its retries are spent."""
    sweep_id, keys = plan(instance, factory_home, lrs=(1e-3, 3e-3))
    members_at(lake, sweep_id, keys, ["succeeded", "interrupted"])
    killed = create_run_for_test(instance, job_name="sweep_member_job", status=DagsterRunStatus.FAILURE,
                                 tags={SWEEP_TAG: sweep_id, MEMBER_TAG: keys[1], WILL_RETRY_TAG: "true"})
    assert reason(tick(sweep_summarizer, instance)) == (
        f"sweep {sweep_id}: 1 of 2 members not ended (0 running, 0 queued, 1 interrupted, which Dagster's retry "
        "resumes)")
    instance.add_run_tags(killed.run_id, {WILL_RETRY_TAG: "false"})  # its retries are spent: it ended interrupted
    (request,) = tick(sweep_summarizer, instance).run_requests
    assert request.partition_key == sweep_id


def test_checkpoint_eval_has_only_the_partitions_a_checkpoint_can_materialize(instance, factory_home, lake):
    """An arithmetic run's checkpoint is scored on its held-out split and carry_chains, a code run's on its held-out
    split alone: once the sensor has registered them, the asset has those partitions and no other (the checkpoint x
    benchmark cross product showed humaneval of arithmetic checkpoints as "Missing (4)", never to materialize)."""
    from assets.evals import checkpoint_eval

    base = dict(name="t", spec_fingerprint="f", code_version="c", status="succeeded", seed=0, started_at=T0)
    lake.upsert("runs", [dict(base, run_id=run, spec=json.dumps({"task": {"name": task}}))
                         for run, task in (("arith", "arithmetic"), ("code", "code"))])
    lake.upsert("checkpoints", [dict(run_id=run, step=2, kind="rl", uri=f"/ckpt/{run}", bytes=1, sha256="0" * 64,
                                     recorded_at=T0 + timedelta(seconds=i)) for i, run in enumerate(("arith", "code"))])
    for req in tick(new_checkpoint_evals, instance).dynamic_partitions_requests:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    keys = checkpoint_eval.partitions_def.get_partition_keys(dynamic_partitions_store=instance)
    assert sorted(keys) == ["carry_chains|arith@2", "heldout|arith@2", "heldout|code@2"]
