"""Sweep planning: expansion, validation that names the axis, the stored plan."""

import re
from pathlib import Path

import pytest

from factory.cockpit.sweep import (
    KEY_LABEL_MAX,
    SweepDefinition,
    SweepError,
    axis_tags,
    format_value,
    key_label,
    member_key,
    member_label,
    member_short,
    next_launches,
    plan_sweep,
    read_member,
    read_sweep,
    read_warm_start_spec,
    short_label,
    sweep_dir,
    sweep_id_of,
    trial_member,
    write_sweep,
    write_warm_start_spec,
)

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")


def test_grid_expands_every_combination_with_names_and_shared_warm_starts():
    axes = {"algorithm.lr": [1e-5, 3e-5], "algorithm.group_size": [4, 8], "seed": [0, 1]}
    plan = plan_sweep(SweepDefinition(name="LR sweep", base_spec=BASE, max_concurrent=3, axes=axes))
    assert len(plan.members) == 8
    assert plan.sweep_id.startswith("lr-sweep-")
    assert [m.key.partition("-lr=")[0] for m in plan.members] == [f"{plan.sweep_id}-m{i:03d}" for i in range(8)]
    assert {(m.spec.algorithm.lr, m.spec.algorithm.group_size, m.spec.seed) for m in plan.members} == {
        (lr, g, s) for lr in (1e-5, 3e-5) for g in (4, 8) for s in (0, 1)}
    assert all(m.spec.name == f"lr-sweep-m{m.index:03d}" for m in plan.members)
    # lr and group size are RL settings: members that differ only in them share a warm start; seeds do not
    assert len(plan.warm_starts()) == 2
    assert {m.warm_start for m in plan.members if m.spec.seed == 0} != {m.warm_start for m in plan.members
                                                                       if m.spec.seed == 1}
    assert all(m.warm_start == f"sft-{m.spec.warm_start_fingerprint()}" for m in plan.members)


def test_random_mode_draws_distinct_members_reproducibly():
    defn = SweepDefinition(base_spec=BASE, mode="random", samples=5, draw_seed=7,
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
    with pytest.raises(SweepError, match="base_spec nope.yaml: no such spec file") as e:
        plan_sweep(SweepDefinition(base_spec="nope.yaml", axes={"seed": [0]}))
    assert e.value.one_line() == ("invalid sweep (nothing was launched): base_spec nope.yaml: no such spec file: "
                                  "nope.yaml")
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


def test_warm_start_specs_are_written_once_and_read_back(factory_home):
    plan = plan_sweep(SweepDefinition(base_spec=BASE, axes={"algorithm.lr": [1e-4, 3e-4]}))
    ((name, spec),) = plan.warm_starts().items()
    path = write_warm_start_spec(factory_home, name, spec)
    assert read_warm_start_spec(factory_home, name).warm_start_fingerprint() == spec.warm_start_fingerprint()
    other = plan.members[1].spec  # same warm start, another lr: the stored spec is kept
    assert write_warm_start_spec(factory_home, name, other) == path and read_warm_start_spec(factory_home, name) == spec
    with pytest.raises(FileNotFoundError, match="no warm start 'sft-x'"):
        read_warm_start_spec(factory_home, "sft-x")


def test_members_are_told_apart_by_their_axis_values():
    values = {"algorithm.lr": 3e-4, "seed": 0, "sft.stop_at_accuracy": None, "algorithm.name": "grpo",
              "schedule.exact": True}
    assert member_label(values) == "algorithm.lr=0.0003 seed=0 sft.stop_at_accuracy=null algorithm.name=grpo " \
                                   "schedule.exact=true"
    assert axis_tags({"algorithm.lr": 1e-5, "seed": 1}) == {"axis/algorithm.lr": "1e-05", "axis/seed": "1"}
    assert format_value([2, 3]) == "[2, 3]"


MEMBERS = [{"key": f"m{i}", "warm_start": "sft-a" if i < 3 else "sft-b"} for i in range(4)]


def test_next_launches_trains_a_warm_start_first_and_holds_the_limit():
    # nothing started: one warm start takes the only slot, its members wait
    first = next_launches(MEMBERS, set(), {}, in_flight=0, max_concurrent=1)
    assert (first.warm_starts, first.members, first.finished) == (["sft-a"], [], False)
    # while it trains, nothing more (the slot is taken)
    assert next_launches(MEMBERS, set(), {"sft-a": "running"}, 1, 1).warm_starts == []
    # with two slots, the other warm start trains beside it; sft-a's members still wait
    two = next_launches(MEMBERS, set(), {"sft-a": "running"}, 1, 2)
    assert (two.warm_starts, two.members) == (["sft-b"], [])
    # ready: members in order, as many as the free slots
    ready = next_launches(MEMBERS, set(), {"sft-a": "ready", "sft-b": "running"}, 1, 3)
    assert ready.members == ["m0", "m1"] and not ready.finished
    # a failed warm start does not hang the sweep: its members start (and report the failure themselves)
    last = next_launches(MEMBERS, {"m0", "m1", "m2"}, {"sft-a": "ready", "sft-b": "failed"}, 0, 2)
    assert last.members == ["m3"] and last.finished
    assert next_launches(MEMBERS, {"m0", "m1", "m2", "m3"}, {}, 0, 1).finished


def test_blend_weights_and_curriculum_settings_are_sweep_axes():
    blend = str(Path(__file__).parents[2] / "examples" / "blend.yaml")
    axes = {"data.curriculum.kind": ["none", "online", "priority"], "data.schedule.100.add4": [0.4, 0.8]}
    plan = plan_sweep(SweepDefinition(name="curricula", base_spec=blend, axes=axes))
    assert {(m.spec.data.curriculum.kind, m.spec.data.schedule[100]["add4"]) for m in plan.members} == {
        (k, w) for k in ("none", "online", "priority") for w in (0.4, 0.8)}
    # a curriculum setting that cannot work names its axis and the member
    with pytest.raises(SweepError, match=r"axes.data.curriculum.kind = 'level'.*curriculum.levels"):
        plan_sweep(SweepDefinition(name="bad", base_spec=blend, axes={"data.curriculum.kind": ["online", "level"]}))


def test_seeds_repeat_every_point_as_the_seed_axis():
    plan = plan_sweep(SweepDefinition(base_spec=BASE, axes={"algorithm.lr": [1e-5, 3e-5]}, seeds=[0, 1, 2]))
    assert [m.values for m in plan.members] == [{"algorithm.lr": lr, "seed": s} for lr in (1e-5, 3e-5)
                                                 for s in (0, 1, 2)]
    assert [m.spec.seed for m in plan.members] == [0, 1, 2, 0, 1, 2]
    only = plan_sweep(SweepDefinition(base_spec=BASE, seeds=[3, 4]))  # seeds alone: the base point, twice
    assert [m.values for m in only.members] == [{"seed": 3}, {"seed": 4}]
    with pytest.raises(SweepError, match=r"seeds: the axis `seed` is given too \(axes.seed\)"):
        plan_sweep(SweepDefinition(base_spec=BASE, axes={"seed": [0]}, seeds=[1]))
    with pytest.raises(SweepError, match=r"seeds: each seed once, got \[1, 1\]"):
        plan_sweep(SweepDefinition(base_spec=BASE, axes={"algorithm.lr": [1e-5]}, seeds=[1, 1]))


def test_a_members_short_label_names_each_axis_by_its_last_segment_with_compact_values():
    assert short_label({"algorithm.lr": 3e-4, "seed": 1}) == "lr=3e-4,seed=1"
    assert short_label({"algorithm.lr": 0.001, "algorithm.kl_coef": 0.05, "rollout.temperature": 1.0}) == \
        "lr=1e-3,kl_coef=0.05,temperature=1.0"
    assert short_label({"algorithm.lr": 1e-5, "sft.stop_at_accuracy": None, "x.flag": True}) == \
        "lr=1e-5,stop_at_accuracy=null,flag=true"
    # two axes ending the same are told apart by their whole path
    assert short_label({"sft.lr": 1e-4, "algorithm.lr": 2.5e-6, "seed": 0}) == "sft.lr=1e-4,algorithm.lr=2.5e-6,seed=0"
    assert short_label({}) == "(base)"


def test_member_keys_carry_a_readable_label_made_safe_for_dagster_and_file_names():
    plan = plan_sweep(SweepDefinition(name="LR sweep", base_spec=BASE, axes={"algorithm.lr": [3e-4, 1e-5]},
                                      seeds=[0, 1]), sweep_id="lr-sweep-20261127-080000-abc123")
    assert [m.key for m in plan.members] == [
        "lr-sweep-20261127-080000-abc123-m000-lr=3e-4_seed=0", "lr-sweep-20261127-080000-abc123-m001-lr=3e-4_seed=1",
        "lr-sweep-20261127-080000-abc123-m002-lr=1e-5_seed=0", "lr-sweep-20261127-080000-abc123-m003-lr=1e-5_seed=1"]
    assert member_key("s", 7, {}) == "s-m007"  # a member with no axes: no label
    # ',' (the separator of a typed partition selection), '/', spaces, brackets, unicode and '...' (Dagster's
    # range delimiter) never reach a key
    assert key_label({"task.name": "a/b c", "model.layers": [2, 3], "x.tag": "ünï…", "y.r": "1...5"}) == \
        "name=a_b_c_layers=_2_3_tag=_n_r=1_5"
    assert key_label({}) == ""


def test_a_long_label_is_cut_with_a_hash_of_the_whole_label_so_keys_differ():
    a = key_label({"task.prompt": "x" * 100 + "a"})
    b = key_label({"task.prompt": "x" * 100 + "b"})
    assert len(a) == len(b) == KEY_LABEL_MAX and a != b and a.startswith("prompt=xxxx")
    assert re.fullmatch(r"prompt=x+_[0-9a-f]{8}", a)
    key = member_key("s", 3, {"task.prompt": "x" * 100 + "a"})
    assert sweep_id_of(key) == "s" and member_short(key) == "m003"


@pytest.mark.parametrize("key,sweep_id,short", [
    ("lr-sweep-20261127-080000-abc123-m000", "lr-sweep-20261127-080000-abc123", "m000"),  # the old form
    ("s-m012", "s", "m012"),
    ("exp-m1-20261127-080000-abc123-m004", "exp-m1-20261127-080000-abc123", "m004"),  # '-m1' in the sweep id
    ("lr-sweep-20261127-080000-abc123-m002-lr=1e-5_seed=0", "lr-sweep-20261127-080000-abc123", "m002"),
    ("exp-m1-20261127-080000-abc123-m004-lr=3e-4", "exp-m1-20261127-080000-abc123", "m004"),
    ("s-m001-name=run-m123", "s", "m001"),  # a '-m123' inside a value
    ("s-m001-name=x-m5-y=z", "s", "m001"),  # ... followed by something that looks like another label
    ("s-m001-my-set=0.5", "s", "m001"),  # a '-' in the first axis name (a blend's dataset name)
    ("s-m1000-seed=3", "s", "m1000"),
])
def test_sweep_id_of_reads_old_and_new_member_keys(key, sweep_id, short):
    assert sweep_id_of(key) == sweep_id and member_short(key) == short


@pytest.mark.parametrize("values", [
    {"task.name": "run-m123"}, {"task.name": "a/b"}, {"task.prompt": "long " * 40}, {"task.name": "ünïcødé"},
    {"data.mix.my-set": 0.5, "seed": 1}, {"algorithm.lr": 3e-4, "task.name": "x-m5-y=z"},
])
def test_every_new_key_parses_back_to_its_sweep_and_index(values):
    for sweep_id in ("lr-sweep-20261127-080000-abc123", "exp-m1-20261127-080000-abc123", "s"):
        key = member_key(sweep_id, 42, values)
        assert sweep_id_of(key) == sweep_id and member_short(key) == "m042", key
        assert re.fullmatch(r"[A-Za-z0-9=._+-]+", key) and "..." not in key and "," not in key, key


@pytest.mark.parametrize("key", ["run-123", "s-mx", "s-m", "-m001", "s-m001-noequals", "s-m001-"])
def test_a_key_that_is_not_a_member_key_is_refused_by_name(key):
    with pytest.raises(ValueError, match="not a sweep member key"):
        sweep_id_of(key)


def test_a_sweep_id_with_an_equals_sign_is_refused():
    with pytest.raises(ValueError, match="sweep_id: .*'='"):
        member_key("a=b", 0, {"seed": 1})


def test_a_tpe_trials_member_key_carries_its_params(factory_home):
    defn = SweepDefinition(name="search", base_spec=BASE, mode="tpe", trials=2,
                           space={"algorithm.lr": {"low": 1e-5, "high": 1e-3, "log": True}})
    plan = plan_sweep(defn, sweep_id="search-20261127-080000-abc123")
    write_sweep(plan, factory_home)
    member = trial_member(factory_home, plan.sweep_id, 1, {"algorithm.lr": 2.5e-4})
    assert member.key == "search-20261127-080000-abc123-m001-lr=2.5e-4"
    assert sweep_id_of(member.key) == plan.sweep_id
