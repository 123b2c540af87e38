"""The live sweep page (`sweep_live`): sensor evaluations over a real lake, a real temp Dagster instance and a real
MLflow store, with a sweep launched by the `sweep` job whose members are partly trained: their `steps`, `evals`,
`interruptions` and `sweeps` rows written as the trainer writes them, their Dagster runs made with Dagster's
`create_run_for_test` (a run record with the progress tags a training run reports). What the daemon would do with
the sensor's observations is done here with `report_runless_asset_event`, and read back from the instance."""

import base64
import re
import struct
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from dagster import AssetKey, AssetMaterialization, DagsterInstance, DagsterRunStatus, build_sensor_context
from dagster._core.test_utils import create_run_for_test
from dagster._daemon.types import DaemonHeartbeat
from pyiceberg.expressions import EqualTo

from factory.cockpit.sweep import LABEL_TAG, MEMBER_TAG, SWEEP_TAG, read_sweep
from factory.lake import Lake
from jobs import defs
from jobs.sweep_live import sweep_live
from jobs.sweeps import sweep_launcher

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=10", "schedule.eval_pass_k=2"]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def instance(factory_home):
    with DagsterInstance.ephemeral() as inst:
        inst.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "SENSOR", None, []))
        yield inst


def tick(instance, cursor=None):
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources) as ctx:
        result = sweep_live(ctx)
    for event in result.asset_events:  # what the daemon does with them
        instance.report_runless_asset_event(event)
    return result


def member(lake, key: str, **fields) -> None:
    """A member's `sweeps` row changed as factory/runs/experiment.py changes it."""
    (row,) = lake.read("sweeps", EqualTo("member", key)).to_pylist()
    lake.upsert("sweeps", [dict(row, **fields, recorded_at=datetime.now(UTC))])


def steps(lake, run_id: str, numbers, attempt: int = 1, gap: bool = False) -> None:
    """`steps` rows as the trainer records them: 10 s a step; with `gap`, the sampler/trainer gap measured."""
    lake.upsert("steps", [dict(run_id=run_id, step=s, weight_version=s, reward_mean=0.05 * s + 0.1 * attempt,
                               accuracy=0.05 * s, attempt=attempt, recorded_at=T0 + timedelta(seconds=10 * s),
                               **(dict(gap_abs_mean=0.01 * s, gap_kl=1e-4 * s) if gap else {}))
                          for s in numbers])


def held_out(lake, run_id: str, step: int, value: float) -> None:
    lake.upsert("evals", [dict(run_id=run_id, step=step, benchmark="arithmetic_heldout", metric="accuracy",
                               value=value, n=500, recorded_at=T0 + timedelta(seconds=10 * step))])


def observations(instance, sweep_id: str) -> list:
    records = instance.fetch_observations(AssetKey("sweep_summary"), limit=100).records
    return [r.asset_observation for r in records if r.partition_key == sweep_id]


def table(obs) -> dict[str, dict]:
    return {r.data["label"]: r.data for r in obs.metadata["members_table"].records}


def png_sizes(obs) -> list[tuple[int, int]]:
    """The width and height of each embedded picture, read from its PNG header (IHDR)."""
    md = obs.metadata["pictures"].value
    pngs = [base64.b64decode(b) for b in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", md)]
    return [struct.unpack(">II", p[16:24]) for p in pngs]


def png_widths(obs) -> list[int]:
    return [w for w, _ in png_sizes(obs)]


def test_a_running_sweep_is_observed_with_its_curves_and_statuses_only_when_something_changed(instance,
                                                                                               factory_home):
    launched = defs.resolve_job_def("sweep").execute_in_process(run_config={"ops": {"plan_and_queue_sweep": {
        "config": {"name": "live", "base_spec": BASE, "overrides": TINY,
                   "axes": {"algorithm.lr": [1e-3, 3e-4, 1e-2]}}}}}, instance=instance)
    sweep_id = launched.output_for_node("plan_and_queue_sweep")["sweep_id"]
    a, b, c = (m["key"] for m in read_sweep(factory_home, sweep_id)["members"])
    assert (a, b, c) == (f"{sweep_id}-m000-lr=1e-3", f"{sweep_id}-m001-lr=3e-4", f"{sweep_id}-m002-lr=0.01")
    lake = Lake.open(factory_home)
    # a trains (steps 1-4, an eval at step 2); b was killed at step 3 and resumed from step 2; c waits for a slot
    member(lake, a, status="running", run_id="run-a")
    steps(lake, "run-a", range(1, 5), gap=True)  # a measures the sampler/trainer gap; b does not
    held_out(lake, "run-a", 2, 0.4)
    member(lake, b, status="running", run_id="run-b")
    steps(lake, "run-b", range(1, 4))
    steps(lake, "run-b", range(3, 5), attempt=2)
    lake.upsert("interruptions", [dict(run_id="run-b", attempt=1, cause="killed", last_step=3, resumed_from_step=2,
                                       steps_lost=1, recorded_at=T0)])
    create_run_for_test(instance, job_name="sweep_member_job", status=DagsterRunStatus.STARTED,
                        tags={SWEEP_TAG: sweep_id, MEMBER_TAG: a, "factory/progress": "grpo 5/10",
                              "factory/eta": "50s"})

    first = tick(instance)
    (obs,) = first.asset_events
    assert obs.asset_key == AssetKey("sweep_summary") and obs.partition == sweep_id
    # the tick starts no run, so it says what it did (without a reason it read "0 runs requested" and nothing else)
    assert first.skip_reason.skip_message == f"recorded the page of {sweep_id}"
    rows = table(obs)
    assert list(rows) == ["lr=1e-3", "lr=3e-4", "lr=0.01"]  # members by their axis values
    assert rows["lr=1e-3"]["status"] == "training" and rows["lr=1e-3"]["detail"] == "grpo 5/10, ETA 50s"
    assert rows["lr=3e-4"]["status"] == "resumed"
    # b has no Dagster run tags here: its step and ETA come from the lake (attempt 2: 10 s a step, 6 steps left)
    assert rows["lr=3e-4"]["detail"] == "step 4/10, ETA 1m00s; resumed from step 2 after attempt 1 was killed"
    assert (rows["lr=0.01"]["status"], rows["lr=0.01"]["step"]) == ("queued", None)
    assert rows["lr=1e-3"]["accuracy"] == "0.400 [0.358, 0.444] n=500"
    assert obs.metadata["status"].value == "1 training, 1 resumed, 1 queued"
    assert [w <= 1000 for w in png_widths(obs)] == [True]  # one picture, within the page
    assert png_sizes(obs) == [(640, 720)]  # with the gap's row under the reward and accuracy panels
    assert "get-artifact" in obs.metadata["curves"].value  # drawn in place from the MLflow parent run
    assert len(observations(instance, sweep_id)) == 1

    again = tick(instance, first.cursor)
    assert again.asset_events == [] and "nothing new" in again.skip_reason.skip_message
    assert len(observations(instance, sweep_id)) == 1  # the event log holds no copy

    steps(lake, "run-a", [5])  # a new step landed
    third = tick(instance, again.cursor)
    (obs,) = third.asset_events
    assert table(obs)["lr=1e-3"]["step"] == 5
    assert len(observations(instance, sweep_id)) == 2

    # every member ends: a is done, b pruned, c failed; the final state is recorded once, then nothing
    held_out(lake, "run-a", 10, 0.5)
    member(lake, a, status="succeeded", final_accuracy=0.5)
    member(lake, b, status="pruned", reason="below the median of finished trials at step 4")
    member(lake, c, status="failed")
    last = tick(instance, third.cursor)
    (obs,) = last.asset_events
    rows = table(obs)
    assert (rows["lr=1e-3"]["status"], rows["lr=1e-3"]["detail"], rows["lr=1e-3"]["accuracy"]) == (
        "done", "arithmetic_heldout at step 10", "0.500 [0.456, 0.544] n=500")
    assert (rows["lr=3e-4"]["status"], rows["lr=3e-4"]["detail"]) == (
        "pruned", "below the median of finished trials at step 4")
    assert rows["lr=0.01"]["status"] == "failed"
    quiet = tick(instance, last.cursor)
    assert quiet.asset_events == [] and quiet.cursor == "{}"
    assert len(observations(instance, sweep_id)) == 3


def test_member_runs_carry_their_axis_values_as_a_label_tag(instance, factory_home):
    launched = defs.resolve_job_def("sweep").execute_in_process(run_config={"ops": {"plan_and_queue_sweep": {
        "config": {"name": "tags", "base_spec": BASE, "overrides": TINY, "axes": {"algorithm.lr": [1e-3, 3e-4]},
                   "seeds": [0]}}}}, instance=instance)
    sweep_id = launched.output_for_node("plan_and_queue_sweep")["sweep_id"]
    for ws in {m["warm_start"] for m in read_sweep(factory_home, sweep_id)["members"]}:  # the warm start is ready
        instance.report_runless_asset_event(AssetMaterialization("sweep_warm_start", partition=ws))
    with build_sensor_context(instance=instance, resources=defs.resources) as ctx:
        requests = sweep_launcher(ctx).run_requests
    assert sorted(r.tags[LABEL_TAG] for r in requests) == ["lr=1e-3,seed=0", "lr=3e-4,seed=0"]


def test_a_member_interrupted_by_a_killed_run_worker_says_dagster_retries_it():
    """Issue 32: between the kill and the retry's creation the member's latest run is failed, awaiting its retry."""
    from dagster import DagsterRun
    from dagster._core.storage.tags import WILL_RETRY_TAG

    from factory.cockpit.sweep_live import MemberLive
    from jobs.sweep_live import member_status

    m = MemberLive(member="s-m000", label="lr=1e-3", status="interrupted", run_id="r", step=3, steps=10, eta_s=None,
                   reason=None, interruptions=[dict(attempt=1, cause="supervisor_lost", last_step=3)])
    waiting = DagsterRun(job_name="sweep_member_job", run_id="x", status=DagsterRunStatus.FAILURE,
                         tags={WILL_RETRY_TAG: "true"})
    status, detail = member_status(m, waiting)
    assert status == "interrupted" and detail.startswith("attempt 1 ") and detail.endswith(
        " at step 3; Dagster is retrying it")
    spent = DagsterRun(job_name="sweep_member_job", run_id="x", status=DagsterRunStatus.FAILURE,
                       tags={WILL_RETRY_TAG: "false"})
    assert member_status(m, spent)[1] == detail.removesuffix("; Dagster is retrying it")
