"""A sweep over blend weights through the launchpad's `sweep` job: members are planned and validated like any
axis (a negative weight or an unknown source is refused naming the axis), and a member's run trains on the blend
its weights describe (the `step_sources` rows of its run). Real Dagster runs in a temp instance, as in
tests/jobs/test_sweeps.py, on a tiny spec with a data section (tests/jobs/specs/blend_tiny.yaml)."""

from pathlib import Path

import pytest
from dagster import DagsterInstance
from pyiceberg.expressions import EqualTo

from assets.sweeps import sweep_members
from factory.cockpit.sweep import read_member
from factory.lake import Lake
from jobs.sweeps import sweep_launcher
from tests.jobs.test_sweeps import _failure, daemon_running, execute, tick

SPEC = str(Path(__file__).parent / "specs" / "blend_tiny.yaml")
AXIS = "data.weights.add2"


def launch(instance, axes, **config):
    from jobs import defs

    cfg = {"name": "blend", "base_spec": SPEC, "axes": axes, **config}
    return defs.resolve_job_def("sweep").execute_in_process(
        run_config={"ops": {"plan_and_queue_sweep": {"config": cfg}}}, instance=instance, raise_on_error=False)


@pytest.fixture
def instance(factory_home):
    with DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.mark.parametrize("value, why", [(-0.5, "weights must be >= 0, got {'add2': -0.5}"),
                                        ("lots", "Input should be a valid number")])
def test_a_bad_weight_is_refused_naming_the_axis(instance, value, why):
    daemon_running(instance)
    result = launch(instance, {AXIS: [0.2, value]})
    assert not result.success
    message = _failure(result)
    assert message.startswith(f"invalid sweep (nothing was launched): axes.{AXIS} = {value!r}: data")
    assert why in message and "\n" not in message
    assert instance.get_dynamic_partitions(sweep_members.name) == []


def test_an_unknown_source_is_refused_naming_the_axis(instance):
    daemon_running(instance)
    result = launch(instance, {"data.weights.add9": [1.0]})
    assert _failure(result) == ("invalid sweep (nothing was launched): axes.data.weights.add9 = 1.0: data: weights: "
                                "unknown source(s) ['add9'] (sources: ['add2', 'add3'])")


@pytest.mark.slow
def test_members_train_on_the_blend_their_weights_describe(instance, factory_home):
    daemon_running(instance)
    result = launch(instance, {AXIS: [0.2, 0.8]}, max_concurrent=2)
    assert result.success
    keys = result.output_for_node("plan_and_queue_sweep")["members"]
    specs = {k: read_member(factory_home, k)[0] for k in keys}
    assert sorted(s.data.weights[ "add2"] for s in specs.values()) == [0.2, 0.8]
    assert all(s.data.weights["add3"] == 0.5 for s in specs.values())  # the base's weight, untouched

    first = tick(sweep_launcher, instance)
    (warm,) = first.run_requests  # one SFT warm start: the blend is an RL setting, members share it
    execute(instance, warm)
    members = tick(sweep_launcher, instance, first.cursor).run_requests
    assert sorted(m.partition_key for m in members) == keys  # both at once (max_concurrent 2)
    assert sorted(m.tags[f"axis/{AXIS}"] for m in members) == ["0.2", "0.8"]
    for req in members:
        execute(instance, req)

    lake = Lake.open(factory_home)
    rows = {r["member"]: r for r in lake.read("sweeps").to_pylist()}
    for key, spec in specs.items():
        assert rows[key]["status"] == "succeeded"
        w = spec.data.weights
        target = w["add2"] / (w["add2"] + w["add3"])
        steps = lake.read("step_sources", EqualTo("run_id", rows[key]["run_id"])).to_pylist()
        groups = {s: sum(r["groups"] for r in steps if r["source"] == s) for s in ("add2", "add3")}
        total = sum(groups.values())
        assert total == spec.schedule.steps * spec.rollout.prompts_per_step  # every step trained a full batch
        assert {round(r["target_share"], 6) for r in steps if r["source"] == "add2"} == {round(target, 6)}
        # exact quotas: within one prompt of the weight's share over the whole stream
        assert abs(groups["add2"] - target * total) < 1, (key, groups, target)
