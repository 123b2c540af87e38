"""Sweeps: a base spec and axes over its fields, expanded into validated member specs, and their record.

A sweep is defined by `SweepDefinition`: the base spec (a YAML path or an inline mapping), axes
(`{"algorithm.lr": [1e-5, 3e-5], "seed": [0, 1]}`), `grid` (every combination) or `random`
(`samples` combinations drawn without repeats from the grid, seeded), and how many members may
run at once. `plan_sweep` expands and validates every member *before* anything is written or
launched: an empty axis, an unknown field or a value of the wrong type is a `SweepError` whose
lines name the axis (and the member's values). `write_sweep` stores the plan under
FACTORY_HOME/sweeps/<sweep_id>/ (atomically: a temp directory renamed into place) and
`read_member` gives a member's spec back to whatever trains it.

Concurrency is enforced by Dagster's run queue, not here: each member carries a lane tag
(`lane_tag`), and the instance allows one run per lane (see `dagster_instance_yaml`), so a sweep
with `max_concurrent: N` spreads its members over N lanes and never runs more than N at once.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from factory.config import ExperimentSpec, SpecError, apply_overrides, load_spec, parse_spec
from factory.home import FactoryPaths

LANE_TAG = "factory/lane"  # the run-queue tag with one slot per value (dagster_instance_yaml)
SWEEP_TAG, MEMBER_TAG = "factory/sweep_id", "factory/member"
MAX_MEMBERS = 1024


class SweepError(ValueError):
    """A sweep that cannot be launched; `errors` holds one line per problem, each naming its axis."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid sweep (nothing was launched):\n" + "\n".join(f"  {e}" for e in errors))


class SweepDefinition(BaseModel):
    """What a user writes to launch a sweep (the `sweep` job's config has the same fields)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("sweep", description="names the sweep (and its MLflow parent run)")
    base_spec: str = Field("examples/quickstart.yaml", description="path of the base spec (YAML)")
    base_inline: dict[str, Any] | None = Field(None, description="the base spec inline; replaces base_spec")
    overrides: dict[str, Any] = Field(default_factory=dict, description="fixed field=value for every member")
    axes: dict[str, list[Any]] = Field(default_factory=dict, description="spec field path -> values")
    mode: Literal["grid", "random"] = "grid"
    samples: int | None = Field(None, ge=1, description="random mode: how many members (default: all)")
    seed: int = Field(0, description="random mode: which members are drawn")
    max_concurrent: int = Field(2, ge=1, le=64, description="members running at once (run-queue lanes)")


@dataclass(frozen=True)
class Member:
    key: str  # partition key of the sweep-member asset: <sweep_id>-m<index>
    index: int
    values: dict[str, Any]  # this member's value on every axis
    spec: ExperimentSpec
    lane: str  # run-queue lane tag value


@dataclass(frozen=True)
class SweepPlan:
    sweep_id: str
    definition: SweepDefinition
    base: ExperimentSpec
    members: list[Member]

    def tags(self, member: Member) -> dict[str, str]:
        """Dagster run tags of a member's run."""
        return {SWEEP_TAG: self.sweep_id, MEMBER_TAG: member.key, LANE_TAG: member.lane}


def _slug(name: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return s[:40] or "sweep"


def new_sweep_id(name: str) -> str:
    return f"{_slug(name)}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def _base(defn: SweepDefinition) -> ExperimentSpec:
    try:
        base = parse_spec(defn.base_inline, "base_inline") if defn.base_inline is not None \
            else load_spec(defn.base_spec)
        return apply_overrides(base, defn.overrides) if defn.overrides else base
    except SpecError as e:
        where = "base_inline" if defn.base_inline is not None else f"base_spec {defn.base_spec}"
        raise SweepError([f"{where}: {line}" for line in e.errors]) from None


def _combinations(defn: SweepDefinition) -> list[dict[str, Any]]:
    names = list(defn.axes)
    total = 1
    for values in defn.axes.values():
        total *= len(values)
    if defn.mode == "grid":
        if total > MAX_MEMBERS:
            raise SweepError([f"axes: the grid has {total} members, more than {MAX_MEMBERS}; use mode: random "
                              "with samples"])
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*defn.axes.values())]
    n = min(defn.samples or total, total)
    if n > MAX_MEMBERS:
        raise SweepError([f"samples: {n} members, more than {MAX_MEMBERS}"])
    rng = random.Random(defn.seed)
    # Draw grid indices without repeats, decoding each into one value per axis (no full grid in memory).
    picks = rng.sample(range(total), n) if total <= 10**7 else list(dict.fromkeys(
        rng.randrange(total) for _ in range(4 * n)))[:n]
    out = []
    for idx in picks:
        combo = {}
        for name in reversed(names):
            values = defn.axes[name]
            idx, j = divmod(idx, len(values))
            combo[name] = values[j]
        out.append({k: combo[k] for k in names})
    return out


def plan_sweep(defn: SweepDefinition, sweep_id: str | None = None) -> SweepPlan:
    """Expand and validate every member; raise `SweepError` (every problem, each naming its axis) if any fails."""
    errors = [f"axes.{name}: empty axis (give at least one value)" for name, v in defn.axes.items() if not v]
    if not defn.axes:
        errors.append("axes: no axes (give at least one field path with a list of values)")
    if errors:
        raise SweepError(errors)
    base = _base(defn)
    # Each axis alone first, so a bad field or value is reported once, by its axis, not per member.
    for name, values in defn.axes.items():
        for v in values:
            try:
                apply_overrides(base, {name: v})
            except SpecError as e:
                errors += [f"axes.{name} = {v!r}: {line}" for line in e.errors]
    if errors:
        raise SweepError(errors)
    sweep_id = sweep_id or new_sweep_id(defn.name)
    members = []
    for i, values in enumerate(_combinations(defn)):
        try:
            spec = apply_overrides(base, {**values, "name": f"{_slug(defn.name)}-m{i:03d}"})
        except SpecError as e:  # a combination that is invalid only together (a cross-field rule)
            errors += [f"axes {values}: {line}" for line in e.errors]
            continue
        members.append(Member(key=f"{sweep_id}-m{i:03d}", index=i, values=values, spec=spec,
                              lane=f"{sweep_id}-l{i % defn.max_concurrent}"))
    if errors:
        raise SweepError(errors)
    return SweepPlan(sweep_id, defn, base, members)


def sweep_dir(paths: FactoryPaths, sweep_id: str) -> Path:
    return paths.root / "sweeps" / sweep_id


def write_sweep(plan: SweepPlan, paths: FactoryPaths, extra: dict[str, Any] | None = None) -> Path:
    """Store the plan (definition, one spec per member, and `extra` fields such as the MLflow parent run id)
    atomically; refuses to overwrite a sweep."""
    final = sweep_dir(paths, plan.sweep_id)
    if final.exists():
        raise FileExistsError(f"sweep {plan.sweep_id} already exists at {final}")
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "members").mkdir(parents=True)
    (tmp / "sweep.json").write_text(json.dumps({
        "sweep_id": plan.sweep_id, "definition": plan.definition.model_dump(mode="json"),
        "members": [{"key": m.key, "index": m.index, "values": m.values, "lane": m.lane} for m in plan.members],
        **(extra or {}),
    }, indent=2, sort_keys=True))
    for m in plan.members:
        (tmp / "members" / f"{m.key}.yaml").write_text(m.spec.to_yaml())
    tmp.rename(final)
    return final


def read_sweep(paths: FactoryPaths, sweep_id: str) -> dict[str, Any]:
    path = sweep_dir(paths, sweep_id) / "sweep.json"
    if not path.is_file():
        raise FileNotFoundError(f"no sweep {sweep_id!r} under {path.parent.parent}")
    return json.loads(path.read_text())


def sweep_id_of(member_key: str) -> str:
    """The sweep a member partition key belongs to (`<sweep_id>-m<index>`)."""
    sweep_id, sep, index = member_key.rpartition("-m")
    if not sep or not index.isdigit():
        raise ValueError(f"not a sweep member key: {member_key!r} (expected <sweep_id>-m<index>)")
    return sweep_id


def read_member(paths: FactoryPaths, member_key: str) -> tuple[ExperimentSpec, dict[str, Any]]:
    """A member's spec and its axis values."""
    sweep_id = sweep_id_of(member_key)
    info = read_sweep(paths, sweep_id)
    member = next((m for m in info["members"] if m["key"] == member_key), None)
    if member is None:
        raise KeyError(f"sweep {sweep_id} has no member {member_key!r}")
    spec = load_spec(sweep_dir(paths, sweep_id) / "members" / f"{member_key}.yaml")
    return spec, member["values"]


def dagster_instance_yaml(max_concurrent_runs: int = 8) -> str:
    """The Dagster instance settings Factory needs: a run queue with one run per sweep lane."""
    return yaml.safe_dump({
        "telemetry": {"enabled": False},
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": "QueuedRunCoordinator",
            "config": {
                "max_concurrent_runs": max_concurrent_runs,
                "dequeue_interval_seconds": 1,  # a queued member starts within a second of a free lane
                "tag_concurrency_limits": [
                    {"key": LANE_TAG, "value": {"applyLimitPerUniqueValue": True}, "limit": 1},
                ],
            },
        },
    }, sort_keys=False)
