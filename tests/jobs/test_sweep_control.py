"""Changing a running sweep from the launchpad (`sweep_control`): pausing it, resuming it, raising and lowering its
max_concurrent; the launcher applies each at its next tick. Real Dagster runs in a temp instance; runs seen in
flight are run records made with Dagster's `create_run_for_test`."""

import time
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRunStatus, build_sensor_context
from dagster._core.test_utils import create_run_for_test
from dagster._daemon.types import DaemonHeartbeat

from factory.cockpit.sweep import read_control
from jobs import defs
from jobs.sweeps import sweep_launcher

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=2", "schedule.eval_pass_k=2"]


@pytest.fixture
def instance(factory_home):
    with DagsterInstance.ephemeral() as inst:
        inst.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "SENSOR", None, []))
        yield inst


def change(instance, **config):
    return defs.resolve_job_def("sweep_control").execute_in_process(
        run_config={"ops": {"change_sweep": {"config": config}}}, instance=instance, raise_on_error=False)


def tick(instance):
    with build_sensor_context(instance=instance, resources=defs.resources) as ctx:
        return sweep_launcher(ctx).run_requests


def _failure(result) -> str:
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return failure.event_specific_data.user_failure_data.description


@pytest.mark.slow
def test_pause_resume_and_max_concurrent_take_effect_at_the_next_tick(instance, factory_home):
    launched = defs.resolve_job_def("sweep").execute_in_process(run_config={"ops": {"plan_and_queue_sweep": {
        "config": {"name": "ctl", "base_spec": BASE, "overrides": TINY, "axes": {"seed": [0, 1, 2]},
                   "max_concurrent": 1}}}}, instance=instance)
    sweep_id = launched.output_for_node("plan_and_queue_sweep")["sweep_id"]
    assert len(tick(instance)) == 1  # three warm starts (one per seed), one at a time

    assert change(instance, sweep_id=sweep_id, max_concurrent=3).success
    assert len(tick(instance)) == 3  # raised: all three start
    assert change(instance, sweep_id=sweep_id, paused=True).success
    assert tick(instance) == []  # paused: nothing starts
    assert read_control(factory_home, sweep_id) == {"paused": True, "max_concurrent": 3}
    assert change(instance, sweep_id=sweep_id, paused=False).success
    requests = tick(instance)
    assert len(requests) == 3

    # Lowered to 1 while two of them run: nothing more starts until fewer than 1 are in flight.
    for req in requests[:2]:
        create_run_for_test(instance, job_name=req.job_name, tags=req.tags, status=DagsterRunStatus.STARTED)
    assert len(tick(instance)) == 1  # limit 3, two in flight: the third
    assert change(instance, sweep_id=sweep_id, max_concurrent=1).success
    assert tick(instance) == []


def test_a_bad_change_names_the_field_or_the_sweep(instance, factory_home):
    (factory_home.root / "sweeps" / "s1").mkdir(parents=True)
    (factory_home.root / "sweeps" / "s1" / "sweep.json").write_text('{"sweep_id": "s1", "members": []}')
    bad = change(instance, sweep_id="s1", max_concurrent=0)
    assert _failure(bad) == "sweep unchanged: max_concurrent: must be between 1 and 64, got 0"
    missing = change(instance, sweep_id="nope", paused=True)
    assert _failure(missing).startswith("sweep unchanged: no sweep 'nope' under ")
    assert read_control(factory_home, "s1") == {"paused": False, "max_concurrent": None}
