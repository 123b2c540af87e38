"""Sweeps: a base spec and axes over its fields, expanded into validated member specs, and their record.

A sweep is defined by `SweepDefinition`: the base spec (a YAML path or an inline mapping), axes
(`{"algorithm.lr": [1e-5, 3e-5], "seed": [0, 1]}`), `grid` (every combination) or `random`
(`samples` combinations drawn without repeats from the grid, seeded), and how many members may
run at once. `plan_sweep` expands and validates every member *before* anything is written or
launched (`seeds` repeats every point over training seeds: the axis `seed`, which the sweep summary aggregates
into a mean per point); an empty axis, an unknown field or a value of the wrong type is a `SweepError` whose
lines name the axis (and the member's values). `write_sweep` stores the plan under
FACTORY_HOME/sweeps/<sweep_id>/ (atomically: a temp directory renamed into place) and
`read_member` gives a member's spec back to whatever trains it.

Members that share an SFT warm start (`ExperimentSpec.warm_start_fingerprint`) name it in the plan
(`Member.warm_start`), and its spec is stored once under FACTORY_HOME/warm_starts/, so the warm start
is trained once and the members wait for it. How many members run at once is decided by whatever
launches them (jobs/sweeps.py); `axis_tags` and `member_label` say which member is which.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from factory.cockpit.sweep_search import SearchParam, prune_warnings, search_errors
from factory.config import ExperimentSpec, SpecError, apply_overrides, load_spec, parse_spec
from factory.envs.spec_check import check_spec
from factory.home import FactoryPaths

SWEEP_TAG, MEMBER_TAG, WARM_START_TAG = "factory/sweep_id", "factory/member", "factory/warm_start"
# run tag: how a member's run ended, in the `sweeps` table's words (succeeded, pruned): Dagster's own status says
# SUCCESS for both, since a pruned member ended as meant (docs/ui.md, "One status vocabulary")
STATUS_TAG = "factory/status"
LABEL_TAG = "factory/label"  # run tag: a member's axis values as people read them (`short_label`: lr=3e-4,seed=1)
AXIS_TAG_PREFIX = "axis/"  # one run tag per axis: axis/algorithm.lr = 0.0003
MAX_MEMBERS = 1024


class SweepError(ValueError):
    """A sweep that cannot be launched; `errors` holds one line per problem, each naming its axis."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid sweep (nothing was launched):\n" + "\n".join(f"  {e}" for e in errors))

    def one_line(self) -> str:
        """The problems on one line, as a launch error (the UI shows it without a wall of text)."""
        return "invalid sweep (nothing was launched): " + "; ".join(self.errors)


class SweepDefinition(BaseModel):
    """What a user writes to launch a sweep (the `sweep` job's config has the same fields)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("sweep", description="names the sweep (and its MLflow parent run)")
    base_spec: str = Field("examples/quickstart.yaml", description="path of the base spec (YAML)")
    base_inline: dict[str, Any] | None = Field(None, description="the base spec inline; replaces base_spec")
    overrides: dict[str, Any] = Field(default_factory=dict, description="fixed field=value for every member")
    axes: dict[str, list[Any]] = Field(default_factory=dict, description="spec field path -> values")
    mode: Literal["grid", "random", "tpe"] = Field("grid", description="grid: every combination of the axes; "
                                                   "random: `samples` of them; tpe: Optuna's TPE search over `space`")
    samples: int | None = Field(None, ge=1, description="random mode: how many members (default: all)")
    draw_seed: int = Field(0, description="random mode: which members are drawn; tpe: the sampler's seed (not the "
                           "training seed: sweep that as the axis `seed`)")
    max_concurrent: int = Field(2, ge=1, le=64, description="members of this sweep running at once")
    seeds: list[int] = Field(default_factory=list, description="repeat every point over these training seeds: the "
                             "axis `seed`, which the summary aggregates (points ranked by their mean over seeds)")
    # mode tpe (factory/cockpit/sweep_search.py): members are asked from an Optuna study, one per trial, as slots
    # free up.
    space: dict[str, SearchParam] = Field(default_factory=dict, description="tpe: spec field path -> {low, high, "
                                          "log, step, type} or {choices}")
    trials: int | None = Field(None, ge=1, le=MAX_MEMBERS, description="tpe: how many trials (members) in all")
    prune: Literal["median", "hyperband", "none"] = Field(
        "none", description="tpe: stop hopeless members at a periodic eval (median, hyperband) or never (none)")
    prune_startup_trials: int = Field(3, ge=0, description="tpe, prune: median: completed trials before any "
                                      "member is pruned")


@dataclass(frozen=True)
class Member:
    key: str  # partition key of the sweep-member asset: <sweep_id>-m<index>-<label> (`member_key`)
    index: int
    values: dict[str, Any]  # this member's value on every axis
    spec: ExperimentSpec
    warm_start: str  # name of the shared SFT warm start this member starts from (sft-<fingerprint>)


@dataclass(frozen=True)
class SweepPlan:
    sweep_id: str
    definition: SweepDefinition
    base: ExperimentSpec
    members: list[Member]
    warnings: list[str] = field(default_factory=list)  # valid, but likely not what was meant (one line each)

    def warm_starts(self) -> dict[str, ExperimentSpec]:
        """Each distinct warm start of the sweep with the spec of its first member (all agree on what it needs)."""
        out: dict[str, ExperimentSpec] = {}
        for m in self.members:
            out.setdefault(m.warm_start, m.spec)
        return out


def _slug(name: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return s[:40] or "sweep"


def new_sweep_id(name: str) -> str:
    return f"{_slug(name)}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def _base(defn: SweepDefinition) -> ExperimentSpec:
    try:
        base = check_spec(parse_spec(defn.base_inline, "base_inline")) if defn.base_inline is not None \
            else check_spec(load_spec(defn.base_spec))
        return check_spec(apply_overrides(base, defn.overrides)) if defn.overrides else base
    except SpecError as e:
        where = "base_inline" if defn.base_inline is not None else f"base_spec {defn.base_spec}"
        raise SweepError([f"{where}: {line.removeprefix('<file>: ')}" for line in e.errors]) from None


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
    n = min(defn.samples or total, total)  # random mode draws points; `seeds` repeats each one
    if n > MAX_MEMBERS:
        raise SweepError([f"samples: {n} members, more than {MAX_MEMBERS}"])
    rng = random.Random(defn.draw_seed)
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
    """Expand and validate every member; raise `SweepError` (every problem, each naming its axis) if any fails.
    A tpe sweep's space is validated instead, and its plan has no members yet (its launcher asks for them)."""
    if defn.mode == "tpe":
        base = _base(defn)
        errors = search_errors(defn, base)
        if defn.seeds:
            errors.append("seeds: repeating points over seeds is for grid and random sweeps; a tpe sweep searches "
                          "`space` (put `seed` in it to vary the training seed)")
        if errors:
            raise SweepError(errors)
        return SweepPlan(sweep_id or new_sweep_id(defn.name), defn, base, [], prune_warnings(defn, base))
    errors = [f"axes.{name}: empty axis (give at least one value)" for name, v in defn.axes.items() if not v]
    if not defn.axes and not defn.seeds:
        errors.append("axes: no axes (give at least one field path with a list of values)")
    if defn.seeds and "seed" in defn.axes:
        errors.append("seeds: the axis `seed` is given too (axes.seed); give the seeds once, as `seeds`")
    if len(set(defn.seeds)) != len(defn.seeds):
        errors.append(f"seeds: each seed once, got {defn.seeds}")
    errors += search_errors(defn, None)
    if errors:
        raise SweepError(errors)
    base = _base(defn)
    # Each axis alone first, so a bad field or value is reported once, by its axis, not per member.
    for name, values in {**defn.axes, **({"seed": defn.seeds} if defn.seeds else {})}.items():
        for v in values:
            try:
                check_spec(apply_overrides(base, {name: v}))
            except SpecError as e:
                errors += [f"axes.{name} = {v!r}: {line}" for line in e.errors]
    if errors:
        raise SweepError(errors)
    sweep_id = sweep_id or new_sweep_id(defn.name)
    members = []
    points = _combinations(defn)
    combos = [{**p, "seed": seed} for p in points for seed in defn.seeds] if defn.seeds else points
    if len(combos) > MAX_MEMBERS:
        raise SweepError([f"seeds: {len(points)} points x {len(defn.seeds)} seeds is {len(combos)} members, more "
                          f"than {MAX_MEMBERS}"])
    for i, values in enumerate(combos):
        try:
            spec = check_spec(apply_overrides(base, {**values, "name": f"{_slug(defn.name)}-m{i:03d}"}))
        except SpecError as e:  # a combination that is invalid only together (a cross-field rule)
            errors += [f"axes {values}: {line}" for line in e.errors]
            continue
        members.append(Member(key=member_key(sweep_id, i, values), index=i, values=values, spec=spec,
                              warm_start=f"sft-{spec.warm_start_fingerprint()}"))
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
        "members": [{"key": m.key, "index": m.index, "values": m.values, "warm_start": m.warm_start}
                    for m in plan.members],
        **(extra or {}),
    }, indent=2, sort_keys=True))
    for m in plan.members:
        (tmp / "members" / f"{m.key}.yaml").write_text(m.spec.to_yaml())
    (tmp / BASE_SPEC).write_text(plan.base.to_yaml())  # what a tpe sweep's trials are made from, as launched
    tmp.rename(final)
    return final


BASE_SPEC = "base.yaml"


def trial_member(paths: FactoryPaths, sweep_id: str, number: int, params: dict[str, Any]) -> Member:
    """The member of a tpe sweep's trial `number`: the stored base spec with the trial's `params` applied.
    A `SweepError` names the parameters when they are invalid only together (a cross-field rule)."""
    info = read_sweep(paths, sweep_id)
    base = load_spec(sweep_dir(paths, sweep_id) / BASE_SPEC)
    try:
        spec = check_spec(apply_overrides(base, {**params, "name": f"{_slug(info['definition']['name'])}-m"
                                                 f"{number:03d}"}))
    except SpecError as e:
        raise SweepError([f"trial {number} {params}: {line}" for line in e.errors]) from None
    return Member(key=member_key(sweep_id, number, params), index=number, values=params, spec=spec,
                  warm_start=f"sft-{spec.warm_start_fingerprint()}")


def add_member(paths: FactoryPaths, sweep_id: str, member: Member, **fields: Any) -> dict[str, Any]:
    """Add a tpe sweep's `member` to its stored plan (its spec file first, then `sweep.json` rewritten
    atomically, so a reader sees the member with its spec or not at all), with `fields` (e.g. its trial) on its
    entry; returns the updated sweep. Adding a member that is there already changes nothing."""
    info = read_sweep(paths, sweep_id)
    if any(m["key"] == member.key for m in info["members"]):
        return info
    d = sweep_dir(paths, sweep_id)
    (d / "members" / f"{member.key}.yaml").write_text(member.spec.to_yaml())
    info["members"].append({"key": member.key, "index": member.index, "values": member.values,
                            "warm_start": member.warm_start, **fields})
    update_sweep(paths, sweep_id, info)
    return info


def update_sweep(paths: FactoryPaths, sweep_id: str, info: dict[str, Any]) -> None:
    """Replace the stored `sweep.json` of `sweep_id` with `info` (atomically)."""
    path = sweep_dir(paths, sweep_id) / "sweep.json"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=2, sort_keys=True))
    os.replace(tmp, path)


def read_sweep(paths: FactoryPaths, sweep_id: str) -> dict[str, Any]:
    path = sweep_dir(paths, sweep_id) / "sweep.json"
    if not path.is_file():
        raise FileNotFoundError(f"no sweep {sweep_id!r} under {path.parent.parent}")
    return json.loads(path.read_text())


CONTROL = "control.json"  # beside sweep.json: what an operator changed while the sweep runs (its own file: the
# launcher rewrites sweep.json as it adds a tpe sweep's members, and neither writer may lose the other's change)


def read_control(paths: FactoryPaths, sweep_id: str) -> dict[str, Any]:
    """A sweep's live settings: `paused` (no member or trial starts; running ones go on) and `max_concurrent`
    (None: the definition's)."""
    path = sweep_dir(paths, sweep_id) / CONTROL
    stored = json.loads(path.read_text()) if path.is_file() else {}
    return {"paused": bool(stored.get("paused", False)), "max_concurrent": stored.get("max_concurrent")}


def set_control(paths: FactoryPaths, sweep_id: str, paused: bool | None = None,
                max_concurrent: int | None = None) -> dict[str, Any]:
    """Pause or resume a running sweep, or raise or lower how many of its runs may be in flight; takes effect at
    the launcher's next tick (runs already in flight are not stopped). Returns the live settings."""
    read_sweep(paths, sweep_id)  # FileNotFoundError naming the sweep
    if max_concurrent is not None and not 1 <= max_concurrent <= 64:
        raise SweepError([f"max_concurrent: must be between 1 and 64, got {max_concurrent}"])
    control = read_control(paths, sweep_id)
    if paused is not None:
        control["paused"] = paused
    if max_concurrent is not None:
        control["max_concurrent"] = max_concurrent
    path = sweep_dir(paths, sweep_id) / CONTROL
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(control, sort_keys=True))
    os.replace(tmp, path)
    return control


KEY_LABEL_MAX = 60  # characters of a member key's label; a longer one is cut and ends in a hash of the whole
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9=._+-]+")
# <sweep_id>-m<index>-<label>: the sweep id holds no '=' and the label's first '=' ends its first axis name, so the
# index is the last -m<digits>- before the key's first '=' (a value may hold '-m123' or '=' of its own).
_NEW_KEY = re.compile(r"([^=]+)-m(\d+)-([^=]*=.*)")
_OLD_KEY = re.compile(r"([^=]+)-m(\d+)")  # <sweep_id>-m<index>: sweeps planned before labels, and no-axis members


def key_label(values: dict[str, Any]) -> str:
    """`lr=3e-4_seed=1`: `short_label` made safe for a Dagster partition key and a file name ('' for no axes).
    ',' becomes '_' because Dagster's partition-selection box splits what is typed at commas; every character other
    than letters, digits and `=._+-` (a '/', a space, a bracket, unicode) becomes '_', and '...' (Dagster's range
    delimiter, forbidden in partition keys) too. Past `KEY_LABEL_MAX` characters it is cut and ends in a hash of
    the whole label."""
    if not values:
        return ""
    full = short_label(values)
    label = re.sub(r"\.{3,}", "_", _KEY_UNSAFE.sub("_", full))
    if len(label) <= KEY_LABEL_MAX:
        return label
    digest = hashlib.sha1(full.encode()).hexdigest()[:8]
    head = label[:KEY_LABEL_MAX - len(digest) - 1]
    if "=" not in head:  # an absurdly long first axis name: the label must still hold an '=' to be read back
        head = head[:-1] + "="
    return f"{head}_{digest}"


def member_key(sweep_id: str, index: int, values: dict[str, Any]) -> str:
    """A member's partition key: `<sweep_id>-m<index>-<key_label>` (`...-m003-lr=3e-4_seed=1`), or
    `<sweep_id>-m<index>` for a member without axes. It is also the member's run key, spec file name and
    `sweeps` row key; `sweep_id_of` reads it back (and reads the older `<sweep_id>-m<index>` keys too)."""
    if "=" in sweep_id:
        raise ValueError(f"sweep_id: must not contain '=' (a member key's label starts at its first '='), "
                         f"got {sweep_id!r}")
    label = key_label(values)
    return f"{sweep_id}-m{index:03d}-{label}" if label else f"{sweep_id}-m{index:03d}"


def _parse_key(member_key: str) -> re.Match[str]:
    found = _NEW_KEY.fullmatch(member_key) if "=" in member_key else _OLD_KEY.fullmatch(member_key)
    if found is None:
        raise ValueError(f"not a sweep member key: {member_key!r} (expected <sweep_id>-m<index> or "
                         "<sweep_id>-m<index>-<label with '='>)")
    return found


def sweep_id_of(member_key: str) -> str:
    """The sweep a member partition key belongs to (`<sweep_id>-m<index>[-<label>]`)."""
    return _parse_key(member_key).group(1)


def member_short(member_key: str) -> str:
    """A member key's index part (`m001`): how a sweep's tables and verdicts name a member beside its label."""
    return f"m{_parse_key(member_key).group(2)}"


def read_member(paths: FactoryPaths, member_key: str) -> tuple[ExperimentSpec, dict[str, Any]]:
    """A member's spec and its axis values."""
    sweep_id = sweep_id_of(member_key)
    info = read_sweep(paths, sweep_id)
    member = next((m for m in info["members"] if m["key"] == member_key), None)
    if member is None:
        raise KeyError(f"sweep {sweep_id} has no member {member_key!r}")
    spec = load_spec(sweep_dir(paths, sweep_id) / "members" / f"{member_key}.yaml")
    return spec, member["values"]


def format_value(v: Any) -> str:
    """An axis value as people write it: 0.0003, 1e-05, 8, true, [2, 3]."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return repr(v)
    return v if isinstance(v, str) else json.dumps(v)


def member_label(values: dict[str, Any]) -> str:
    """`algorithm.lr=0.0003 seed=0`: a member told apart by its axis values."""
    return " ".join(f"{k}={format_value(v)}" for k, v in values.items())


def short_label(values: dict[str, Any]) -> str:
    """`lr=3e-4,seed=1`: a member as a person reads it in a legend or a table; each axis named by its last path
    segment (its whole path where two axes end the same), small and large floats in short exponent form."""
    if not values:
        return "(base)"
    lasts = [k.rpartition(".")[2] for k in values]
    names = [last if lasts.count(last) == 1 else k for k, last in zip(values, lasts, strict=True)]
    return ",".join(f"{n}={_compact(v)}" for n, v in zip(names, values.values(), strict=True))


def _compact(v: Any) -> str:
    """An axis value in few characters: 3e-4 for 0.0003, 1e-5 for 1e-05 (else as `format_value`)."""
    if isinstance(v, float) and v != 0.0 and (abs(v) < 1e-2 or abs(v) >= 1e5):
        mantissa, _, exponent = f"{v:.6e}".partition("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return format_value(v)


def axis_tags(values: dict[str, Any]) -> dict[str, str]:
    """Run tags naming a member's axis values (`axis/algorithm.lr: 0.0003`), cut to Dagster's 63 characters."""
    return {f"{AXIS_TAG_PREFIX}{k}"[:70]: format_value(v)[:63] for k, v in values.items()}


def warm_start_path(paths: FactoryPaths, name: str) -> Path:
    return paths.root / "warm_starts" / f"{name}.yaml"


def write_warm_start_spec(paths: FactoryPaths, name: str, spec: ExperimentSpec) -> Path:
    """Store the spec a warm start is trained from (once: an existing one describes the same warm start)."""
    path = warm_start_path(paths, name)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(spec.to_yaml())
        os.replace(tmp, path)
    return path


def read_warm_start_spec(paths: FactoryPaths, name: str) -> ExperimentSpec:
    path = warm_start_path(paths, name)
    if not path.is_file():
        raise FileNotFoundError(f"no warm start {name!r}: {path} does not exist (a sweep writes it when planned)")
    return load_spec(path)


@dataclass(frozen=True)
class Launches:
    warm_starts: list[str]  # warm starts to train now
    members: list[str]  # member keys to start now
    finished: bool  # every member has been started (nothing more to launch for this sweep)


def next_launches(members: list[dict[str, Any]], started: set[str], warm_state: dict[str, str], in_flight: int,
                  max_concurrent: int) -> Launches:
    """What a sweep may start now without more than `max_concurrent` of its runs in flight.

    `members` are the plan's (`key`, `warm_start`) in order; `started` the member keys already launched;
    `warm_state` per warm start: "ready" (materialized), "running", "failed" (ended without one) or "none";
    `in_flight` the sweep's runs (members and warm starts) queued or running. A warm start counts against the
    limit while it trains; its members wait for it, and start after it fails too (they then report the
    failure themselves rather than hang the sweep)."""
    free = max_concurrent - in_flight
    state = dict(warm_state)
    warm, start = [], []
    for m in members:
        if m["key"] in started:
            continue
        ws = state.get(m["warm_start"], "none")
        if ws == "none" and free > 0:
            warm.append(m["warm_start"])
            state[m["warm_start"]] = "running"
            free -= 1
        elif ws in ("ready", "failed") and free > 0:
            start.append(m["key"])
            free -= 1
    return Launches(warm, start, finished=len(started) + len(start) == len(members))


def refuse_member(lake: Any, member_key: str, reason: str) -> dict[str, Any]:
    """Record that a sweep member was refused before it started (the preflight gate): its `sweeps` row goes from
    queued to `refused` with `reason`, so the sweep shows why the member has no run instead of waiting forever.
    `lake` is a `factory.lake.Lake`; returns the row written. A member with no row yet (not planned through the
    sweep job) gets none: there is nothing to correct."""
    sweep_id = sweep_id_of(member_key)
    # a key is data, not expression text
    from pyiceberg.expressions import EqualTo  # noqa: PLC0415 heavy: pyiceberg; `factory validate` imports this module

    rows = lake.read("sweeps", EqualTo("member", member_key)).to_pylist()
    mine = [r for r in rows if r["sweep_id"] == sweep_id]
    if not mine:
        return {}
    row = dict(mine[0], status="refused", reason=reason, recorded_at=datetime.now(UTC))
    lake.upsert("sweeps", [row])
    return row
