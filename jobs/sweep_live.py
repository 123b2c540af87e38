"""`sweep_live`: a running sweep's page, kept current while its members train.

For each sweep with a member not ended, the sensor records an `AssetObservation` of `sweep_summary` on the sweep's
partition: the members' curves overlaid (reward by step, held-out accuracy by step where evals landed, the
sampler/trainer gap by step where members measured it), each member labelled by its axis values (`lr=3e-4,seed=1`),
and a member table with each member's status: queued, training (step/total and ETA, from its Dagster run's
`factory/progress` and `factory/eta` tags, else from the lake's steps), resumed after a crash ("resumed from step 10
after attempt 1 was killed", the lake's `interruptions`), pruned or refused (with the reason), failed, done
(accuracy with its interval).

Only when something changed: the cursor holds, per sweep, each member's status, newest step, eval count and
interruption count at the last observation, so an idle sweep adds nothing to the event log. A sweep's last
observation is its final state (every member ended); the summary (`sweep_summarizer`) follows it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from dagster import (
    AssetKey,
    AssetObservation,
    DagsterRun,
    DefaultSensorStatus,
    MetadataValue,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    TableColumn,
    TableRecord,
    TableSchema,
    sensor,
)

from assets._interruptions import CAUSES
from assets._metadata import embedded, inline_picture
from factory.cockpit.sweep import MEMBER_TAG, SWEEP_TAG
from factory.progress import format_duration
from jobs._queue import IN_FLIGHT
from jobs._ticks import described
from resources import LakeResource, MlflowResource

if TYPE_CHECKING:
    from factory.cockpit.sweep_live import LiveSweep, MemberLive
    from factory.cockpit.tracking import Tracker

LIVE_PICTURE = "plots/live_curves.png"  # on the sweep's MLflow parent run; each observation re-renders it
PROGRESS, ETA = "factory/progress", "factory/eta"  # a member run's progress tags (assets/_metadata.progress_tags)
# Narrow enough for the metadata table's value column (~590 px at a 1600 px window): the ETA is in `detail`.
COLUMNS = ["member", "label", "status", "step", "accuracy", "detail"]


def member_status(m: MemberLive, run: DagsterRun | None) -> tuple[str, str]:
    """A member's status on the live page and what it says beside it, from its `sweeps` row, the lake and its
    latest Dagster run (`run`, None before one was launched)."""
    resumed = [r for r in m.interruptions if r.get("resumed_from_step") is not None]
    crash = "; ".join(f"resumed from step {r['resumed_from_step']} after attempt {r['attempt']} "
                      f"{CAUSES.get(r['cause'], (r['cause'], None))[0]}" for r in resumed)
    flying = run is not None and (run.status in IN_FLIGHT or run.is_complete_and_waiting_to_retry)
    if m.status == "queued":
        return "queued", "its run is starting" if flying else "waiting for a free slot or its warm start"
    if m.status == "running":
        tags = run.tags if flying else {}
        if PROGRESS in tags:  # reported every few seconds: newer than the lake's steps, which land in batches
            where = f"{tags[PROGRESS]}, ETA {tags.get(ETA, '?')}"
        elif m.step is not None:
            where = f"step {m.step}/{m.steps or '?'}, ETA {format_duration(m.eta_s)}"
        else:
            where = "starting"
        return ("resumed" if resumed else "training"), where + (f"; {crash}" if crash else "")
    if m.status == "succeeded":  # its accuracy with the interval is in the table's `accuracy` column
        if m.outcome is not None:
            others = m.outcome.others_text()
            return "done", f"{m.outcome.primary.benchmark} at step {m.outcome.step}" + (f"; {others}" if others else "")
        return "done", "no accuracy eval yet" if m.final_accuracy is None else f"accuracy {m.final_accuracy:.3f}"
    if m.status == "pruned":
        return "pruned", m.reason or "by the sweep's pruner"
    if m.status == "refused":
        return "refused", m.reason or "by the preflight gate"
    # failed, or interrupted (stopped at a resume point): Dagster may retry it (a new attempt resumes the same run)
    retry = "; Dagster is retrying it" if flying else ""
    last = m.interruptions[-1] if m.interruptions else None
    why = (f"attempt {last['attempt']} {CAUSES.get(last['cause'], (last['cause'], None))[0]}"
           + (f" at step {last['last_step']}" if last.get("last_step") is not None else "")) if last else \
        "see its Dagster run"
    return ("interrupted" if m.status == "interrupted" else "failed"), why + retry


def observation(live: LiveSweep, runs: dict[str, DagsterRun], tracker: Tracker | None,
                parent: str | None) -> AssetObservation:
    """The live page of one sweep: its curves overlaid (drawn in place from the MLflow UI and embedded) and its
    member table."""
    from factory.cockpit.plots import DPI  # noqa: PLC0415 heavy: matplotlib; when the sensor ticks
    from factory.cockpit.reports import small, store  # noqa: PLC0415 heavy: mlflow, matplotlib; when the sensor ticks

    records, counts = [], {}
    for m in live.members:
        status, detail = member_status(m, runs.get(m.member))
        counts[status] = counts.get(status, 0) + 1
        records.append(TableRecord({
            # the label wraps between its axes: unbroken, a long one pushed `detail` past the page
            "member": m.short, "label": m.label.replace(",", ", "), "status": status, "step": m.step,
            "accuracy": m.outcome.primary.text() if m.outcome else "", "detail": detail}))
    md: dict[str, Any] = {}
    png = live.picture(DPI)
    if png is not None and tracker is not None and parent:
        store(tracker, parent, LIVE_PICTURE, live.picture, full=png)  # rendered once at full size
        md["curves"] = inline_picture(f"members of {live.sweep_id} so far (served by the MLflow UI; without it, open "
                                      "`pictures`)", tracker.artifact_url(parent, small(LIVE_PICTURE)))
    schema = TableSchema([TableColumn(c, "int" if c == "step" else "string") for c in COLUMNS])
    md.update({
        "status": ", ".join(f"{n} {s}" for s, n in counts.items()),
        "members_table": MetadataValue.table(records, schema=schema),
        **({"pictures": embedded({"members so far": png})} if png is not None else {}),
    })
    return AssetObservation(asset_key=AssetKey("sweep_summary"), partition=live.sweep_id, metadata=md)


def _latest_runs(context: SensorEvaluationContext, sweep_id: str) -> dict[str, DagsterRun]:
    """member -> its latest Dagster run (runs come newest first)."""
    out: dict[str, DagsterRun] = {}
    for r in context.instance.get_runs(RunsFilter(tags={SWEEP_TAG: sweep_id})):
        if MEMBER_TAG in r.tags:
            out.setdefault(r.tags[MEMBER_TAG], r)
    return out


@sensor(minimum_interval_seconds=30, default_status=DefaultSensorStatus.RUNNING,
        description=described("While a sweep runs, records its members' curves overlaid and their statuses on its "
                              "sweep_summary partition, whenever a status, step, eval or interruption is new."))
def sweep_live(context: SensorEvaluationContext, lake: LakeResource, mlflow: MlflowResource) -> SensorResult:
    from factory.cockpit.sweep_live import (  # noqa: PLC0415 heavy: matplotlib, pyiceberg; when the sensor ticks
        live_sweeps,
        sweep_rows,
        unfinished,
    )

    seen: dict[str, dict[str, list]] = json.loads(context.cursor) if context.cursor else {}
    lk = lake.lake()
    rows = sweep_rows(lk)
    # Sweeps with a member not ended, and those observed before whose final state may not be recorded yet.
    wanted = {s: rows[s] for s in sorted(set(unfinished(rows)) | (set(seen) & set(rows)))}
    if not wanted:
        return SensorResult(skip_reason="no sweep has a member queued or training", cursor=json.dumps({}))
    tracker = None
    events, same = [], []
    for sweep_id, live in live_sweeps(lk, wanted).items():
        state = live.fingerprint()
        if seen.get(sweep_id) == state:
            same.append(sweep_id)
        else:
            tracker = tracker or mlflow.tracker()
            parent = next((r["mlflow_parent_run_id"] for r in wanted[sweep_id] if r["mlflow_parent_run_id"]), None)
            events.append(observation(live, _latest_runs(context, sweep_id), tracker, parent))
        # an ended sweep's final state is recorded now (or was): it needs no more ticks
        if live.ended:
            seen.pop(sweep_id, None)
        else:
            seen[sweep_id] = state
    # A tick that records a page starts no run either: it says so (without a reason its tick read "0 runs requested"
    # and nothing else).
    recorded = [e.partition for e in events]
    skip = "; ".join(([f"recorded the page of {', '.join(recorded)}"] if recorded else [])
                     + ([f"nothing new since the last observation of {', '.join(same)}"] if same else []))
    return SensorResult(asset_events=events, skip_reason=skip or None, cursor=json.dumps(seen, sort_keys=True))


__all__ = ["member_status", "observation", "sweep_live"]
