"""A sweep while it runs, from the lake: per member its `sweeps` row, newest step, planned steps, step-time ETA,
interruptions and result so far, and the members' curves overlaid (reward by step, held-out accuracy by step where
evals landed, and the sampler/trainer gap by step where the members measured it), each member labelled by its axis
values (`lr=3e-4,seed=1`).

Cheap enough for a sensor tick: the `sweeps` table once, then `steps` (a few columns), `evals` (accuracy rows) and
`interruptions` once each, filtered by the run ids of the sweeps asked for. `LiveSweep.fingerprint` is what changes
when something new landed (a status, a step, an eval, an interruption), so a caller can tell a new state from a copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pyiceberg.expressions import And, EqualTo, In

from factory.cockpit import plots
from factory.cockpit.sweep import member_short, short_label
from factory.lake.results import METRIC, RunOutcome, outcomes_from_evals
from factory.lake.writer import Lake

ENDED = ("succeeded", "failed", "refused", "pruned")  # a member's `sweeps` status after which it trains no more
STEP_COLUMNS = ["run_id", "step", "reward_mean", "recorded_at", "attempt", *(c for c, _ in plots.SWEEP_GAP)]
SWEEP_COLUMNS = ["sweep_id", "member", "axes", "spec", "status", "run_id", "final_accuracy", "reason", "recorded_at",
                 "mlflow_parent_run_id"]


@dataclass(frozen=True)
class MemberLive:
    """One member of a running sweep as the lake has it now."""

    member: str  # its partition key of `sweep_member_run`
    label: str  # its axis values, `lr=3e-4,seed=1`
    status: str  # its `sweeps` row's: queued, running, succeeded, failed, refused, pruned, interrupted
    run_id: str | None
    step: int | None  # the newest step in `steps` (None: none yet)
    steps: int | None  # the steps its spec plans (schedule.steps)
    eta_s: float | None  # time per step of its current attempt so far times the steps left (None: unknown)
    reason: str | None  # why it was pruned or refused
    interruptions: list[dict[str, Any]] = field(default_factory=list)  # its `interruptions` rows, oldest first
    outcome: RunOutcome | None = None  # its result so far (lake/results.py); None without an accuracy eval
    evals: int = 0  # accuracy rows in `evals`
    final_accuracy: float | None = None  # its `sweeps` row's figure (a member without evals in the lake)

    @property
    def short(self) -> str:
        """The key's index part (`m001`), as the summary's tables show it."""
        return member_short(self.member)

    def fingerprint(self) -> list[Any]:
        """What a new observation is owed for: a new status, a newer step, a new eval or interruption."""
        return [self.status, self.step, self.evals, len(self.interruptions)]


@dataclass(frozen=True)
class LiveSweep:
    sweep_id: str
    members: list[MemberLive]  # by member key
    overlay: list[dict[str, Any]]  # {"label", "steps", "evals"} per member with a run: `plots.sweep_curves_png`

    @property
    def ended(self) -> bool:
        """Every member ended (a tpe sweep may still ask for more trials: its caller knows)."""
        return all(m.status in ENDED for m in self.members)

    def fingerprint(self) -> dict[str, list[Any]]:
        return {m.member: m.fingerprint() for m in self.members}

    def picture(self, dpi: int = plots.DPI) -> bytes | None:
        """The members' curves overlaid (train reward by step; held-out accuracy by step on the benchmark most
        members have; the sampler/trainer gap by step, a second row, where a member measured it); None while no member
        has a step or an eval."""
        training = sum(m.status == "running" for m in self.members)
        title = f"{self.sweep_id}: {training} of {len(self.members)} members training"
        try:
            return plots.sweep_curves_png(self.overlay, title=title, dpi=dpi)
        except ValueError:  # nothing to draw yet
            return None


def sweep_rows(lake: Lake) -> dict[str, list[dict[str, Any]]]:
    """Every `sweeps` row (the columns this module reads), by sweep id."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in lake.read("sweeps").select(SWEEP_COLUMNS).to_pylist():
        out.setdefault(r["sweep_id"], []).append(r)
    return out


def unfinished(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The sweeps with a member that has not ended."""
    return sorted(s for s, rs in rows.items() if any(r["status"] not in ENDED for r in rs))


def live_sweeps(lake: Lake, rows: dict[str, list[dict[str, Any]]]) -> dict[str, LiveSweep]:
    """Each sweep of `rows` (`sweep_rows`, or a part of it) as the lake has it now."""
    run_ids = sorted({r["run_id"] for rs in rows.values() for r in rs if r["run_id"]})
    steps = _by_run(lake.read("steps", In("run_id", run_ids)).select(STEP_COLUMNS).to_pylist() if run_ids else [])
    evals = _by_run(lake.read("evals", And(EqualTo("metric", METRIC), In("run_id", run_ids))).to_pylist()
                    if run_ids else [])
    stops = _by_run(lake.read("interruptions", In("run_id", run_ids)).to_pylist() if run_ids else [])
    outcomes = outcomes_from_evals(r for rs in evals.values() for r in rs)
    out = {}
    for sweep_id, rs in rows.items():
        members = [_member(r, steps.get(r["run_id"], []), evals.get(r["run_id"], []), stops.get(r["run_id"], []),
                           outcomes.get(r["run_id"])) for r in sorted(rs, key=lambda r: r["member"])]
        overlay = [{"label": m.label, "steps": steps.get(m.run_id, []), "evals": evals.get(m.run_id, [])}
                   for m in members if m.run_id]
        out[sweep_id] = LiveSweep(sweep_id, members, overlay)
    return out


def _member(row: dict[str, Any], steps: list[dict], evals: list[dict], stops: list[dict],
            outcome: RunOutcome | None) -> MemberLive:
    planned = _planned_steps(row["spec"])
    newest = max((s["step"] for s in steps), default=None)
    return MemberLive(
        member=row["member"], label=short_label(json.loads(row["axes"])), status=row["status"],
        run_id=row["run_id"], step=newest, steps=planned, eta_s=_eta_s(steps, planned), reason=row["reason"],
        interruptions=sorted(stops, key=lambda r: r["attempt"]), evals=len(evals),
        outcome=outcome if outcome and outcome.primary else None, final_accuracy=row["final_accuracy"])


def _planned_steps(spec_json: str | None) -> int | None:
    try:
        return int(json.loads(spec_json or "{}")["schedule"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None


def _eta_s(steps: list[dict], planned: int | None) -> float | None:
    """Seconds per step of the newest attempt (between its first and newest recorded step) times the steps left."""
    if not steps or planned is None:
        return None
    attempt = max((s.get("attempt") or 0) for s in steps)
    mine = sorted((s for s in steps if (s.get("attempt") or 0) == attempt), key=lambda s: s["step"])
    first, last = mine[0], mine[-1]
    if last["step"] >= planned:
        return 0.0
    if last["step"] <= first["step"] or first["recorded_at"] is None or last["recorded_at"] is None:
        return None
    per_step = (last["recorded_at"] - first["recorded_at"]).total_seconds() / (last["step"] - first["step"])
    return max(0.0, per_step * (planned - last["step"]))


def _by_run(rows: Iterable[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["run_id"], []).append(r)
    return out
