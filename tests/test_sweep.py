"""Sweep planning: expansion, validation that names the axis, the stored plan."""

from pathlib import Path

import pytest

from factory.sweep import (
    LANE_TAG,
    SweepDefinition,
    SweepError,
    dagster_instance_yaml,
    plan_sweep,
    read_member,
    read_sweep,
    sweep_dir,
    sweep_id_of,
    write_sweep,
)

BASE = str(Path(__file__).parents[1] / "examples" / "quickstart.yaml")


def test_grid_expands_every_combination_with_lanes_and_names():
    axes = {"algorithm.lr": [1e-5, 3e-5], "algorithm.group_size": [4, 8], "seed": [0, 1]}
    plan = plan_sweep(SweepDefinition(name="LR sweep", base_spec=BASE, max_concurrent=3, axes=axes))
    assert len(plan.members) == 8
    assert plan.sweep_id.startswith("lr-sweep-")
    assert [m.key for m in plan.members] == [f"{plan.sweep_id}-m{i:03d}" for i in range(8)]
    assert {(m.spec.algorithm.lr, m.spec.algorithm.group_size, m.spec.seed) for m in plan.members} == {
        (lr, g, s) for lr in (1e-5, 3e-5) for g in (4, 8) for s in (0, 1)}
    assert all(m.spec.name == f"lr-sweep-m{m.index:03d}" for m in plan.members)
    assert len({m.lane for m in plan.members}) == 3  # max_concurrent lanes, one run each at a time
    assert plan.tags(plan.members[0])[LANE_TAG] == plan.members[0].lane


def test_random_mode_draws_distinct_members_reproducibly():
    defn = SweepDefinition(base_spec=BASE, mode="random", samples=5, seed=7,
                           axes={"algorithm.lr": [1e-5, 2e-5, 3e-5, 5e-5], "seed": [0, 1, 2]})
    a, b = plan_sweep(defn, sweep_id="s"), plan_sweep(defn, sweep_id="s")
    values = [tuple(m.values.values()) for m in a.members]
    assert len(values) == len(set(values)) == 5
    assert values == [tuple(m.values.values()) for m in b.members]
    assert len(plan_sweep(defn.model_copy(update={"samples": 99}), sweep_id="s").members) == 12  # capped


@pytest.mark.parametrize("axes,named", [
    ({"algorithm.lrr": [1e-5]}, "axes.algorithm.lrr = 1e-05: algorithm.lrr: unknown key"),
    ({"algorithm.lr": ["fast"]}, "axes.algorithm.lr = 'fast': algorithm.lr"),
    ({"algorithm.group_size": [8, 1]}, "axes.algorithm.group_size = 1: algorithm.group_size: must be >= 2"),
    ({"seed": []}, "axes.seed: empty axis"),
    ({}, "axes: no axes"),
])
def test_a_bad_axis_is_named_and_nothing_is_planned(axes, named):
    with pytest.raises(SweepError) as e:
        plan_sweep(SweepDefinition(base_spec=BASE, axes=axes))
    assert any(line.startswith(named) for line in e.value.errors), e.value.errors
    assert "nothing was launched" in str(e.value)


def test_a_bad_base_spec_is_named():
    with pytest.raises(SweepError, match="base_spec nope.yaml: <file>: no such spec file"):
        plan_sweep(SweepDefinition(base_spec="nope.yaml", axes={"seed": [0]}))
    with pytest.raises(SweepError, match="base_inline: .*model.preset"):
        plan_sweep(SweepDefinition(base_inline={"model": {"preset": "huge"}}, axes={"seed": [0]}))


def test_written_plan_reads_back_and_is_never_overwritten(factory_home):
    plan = plan_sweep(SweepDefinition(base_spec=BASE, axes={"seed": [3, 4]}, overrides={"schedule.steps": 7}))
    path = write_sweep(plan, factory_home, extra={"mlflow_parent_run_id": "abc"})
    assert path == sweep_dir(factory_home, plan.sweep_id)
    assert not list(path.parent.glob(".*tmp*"))  # the temp directory was renamed, not left behind
    info = read_sweep(factory_home, plan.sweep_id)
    assert info["mlflow_parent_run_id"] == "abc" and len(info["members"]) == 2
    spec, values = read_member(factory_home, plan.members[1].key)
    assert values == {"seed": 4} and spec == plan.members[1].spec and spec.schedule.steps == 7
    assert sweep_id_of(plan.members[1].key) == plan.sweep_id
    with pytest.raises(FileExistsError):
        write_sweep(plan, factory_home)
    with pytest.raises(KeyError, match="no member"):
        read_member(factory_home, f"{plan.sweep_id}-m999")
    with pytest.raises(ValueError, match="not a sweep member key"):
        sweep_id_of("run-123")


def test_instance_yaml_limits_each_lane_to_one_run():
    import yaml

    cfg = yaml.safe_load(dagster_instance_yaml(4))["run_coordinator"]["config"]
    assert cfg["max_concurrent_runs"] == 4
    assert cfg["tag_concurrency_limits"] == [{"key": LANE_TAG, "value": {"applyLimitPerUniqueValue": True},
                                              "limit": 1}]
