"""Every sensor and schedule of the code location says why a tick starts nothing, and its description says where
that shows in the UI (a skip reason is the "0 runs requested" tag's tooltip: jobs/_ticks.py). Real evaluations on an
empty temp instance and home; the browser side is in tests/e2e/test_ui_live_sweep.py."""

from __future__ import annotations

import pytest
from dagster import AutomationConditionSensorDefinition, build_schedule_context, build_sensor_context, instance_for_test

from jobs import defs
from jobs._ticks import WHY_NONE


@pytest.fixture
def instance(factory_home):
    with instance_for_test() as inst:  # a schedule's context needs an instance with a ref
        yield inst


def _ours(items):
    # the automation sensor's ticks are Dagster's own evaluations of prompt_stats' condition, with no skip reason
    return [i for i in items if not isinstance(i, AutomationConditionSensorDefinition)]


def test_every_sensor_and_schedule_says_where_its_skip_reasons_show():
    repo = defs.get_repository_def()
    described = {i.name: i.description for i in _ours([*repo.sensor_defs, *repo.schedule_defs])}
    assert len(described) == 6, described
    assert {name for name, text in described.items() if not (text or "").endswith(WHY_NONE)} == set()


def test_every_sensor_and_schedule_gives_a_reason_when_it_starts_nothing(instance, lake):
    repo = defs.get_repository_def()
    reasons = {}
    for sensor in _ours(repo.sensor_defs):
        with build_sensor_context(instance=instance, resources=defs.resources) as ctx:
            data = sensor.evaluate_tick(ctx)
        assert not data.run_requests, sensor.name
        reasons[sensor.name] = data.skip_message
    for schedule in repo.schedule_defs:
        with build_schedule_context(instance=instance, resources=defs.resources) as ctx:
            data = schedule.evaluate_tick(ctx)
        reasons[schedule.name] = data.skip_message if not data.run_requests else "a run"
    assert reasons == {
        "sweep_launcher": "no sweep has members left to start",
        "sweep_summarizer": "every sweep is summarized with every eval",
        "sweep_live": "no sweep has a member queued or training",
        "new_checkpoint_evals": "no checkpoint owes an eval",
        "eval_schedule": "no eval to retry",
        "preflight_schedule": reasons["preflight_schedule"],  # a run, or why not (runs of other tests, the env)
    }
    assert reasons["preflight_schedule"]
