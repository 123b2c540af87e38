"""What happened to a run's attempts: telling a dead attempt from a live one, recording each interruption
with its cause and costs, and the run's goodput.

Goodput is the share of a run's wall time not lost to interruptions:
    goodput = 1 - lost_s / wall_s
    lost_s  = sum over interruptions of (redo_s + detect_s + recover_s) + time spent waiting on preflight
where redo_s is the work the interrupted attempt did after its last resume point (trained again),
detect_s the time from its last sign of life to the failure being noticed, and recover_s the time from
then to the next attempt starting its first step (restart, imports, loading, restoring). wall_s runs
from the first attempt's start to the end of the last one. A run never interrupted has goodput 1.0:
its evals and checkpoints are work that counts.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pyiceberg.expressions import EqualTo, In

from factory.config import ExperimentSpec, parse_spec
from factory.lake.writer import Lake
from factory.runs.attempt import AttemptLock, beat_step, last_beat

LIVE = ("running", "resumed")


def now() -> datetime:
    return datetime.now(UTC)


def host() -> str:
    return socket.gethostname()


@dataclass(frozen=True)
class DeadAttempt:
    run_id: str
    attempt: int
    last_step: int | None
    failed_at: datetime  # its last sign of life


def run_row(lake: Lake, run_id: str) -> dict | None:
    rows = lake.read("runs", EqualTo("run_id", run_id)).to_pylist()
    return rows[0] if rows else None


def spec_of_run(row: dict) -> ExperimentSpec:
    """The spec a run was started with (its `runs` row keeps it)."""
    return parse_spec(json.loads(row["spec"]), source=f"run {row['run_id']}")


def last_step(lake: Lake, run_id: str) -> int | None:
    steps = lake.read("steps", EqualTo("run_id", run_id)).column("step").to_pylist()
    return max(steps) if steps else None


def is_dead(row: dict, run_dir: Path) -> bool:
    """A `running`/`resumed` row whose attempt no longer holds its lock on this host (killed, crashed)."""
    if row["status"] not in LIVE or row.get("host") != host():
        return False  # another host's (its own readers decide), or a row that does not say where it runs
    return not AttemptLock.is_held(run_dir)


def mark_dead(lake: Lake, row: dict, run_dir: Path, cause: str = "killed", detail: str | None = None) -> DeadAttempt:
    """Record that the row's current attempt died without saying so: status `interrupted`, an
    `interruptions` row (cause, last step, when it was last alive, how long until noticed)."""
    beat = last_beat(run_dir)
    failed_at = datetime.fromtimestamp(beat, UTC) if beat else (row.get("heartbeat_at") or row["started_at"])
    failed_at = failed_at if failed_at.tzinfo else failed_at.replace(tzinfo=UTC)
    attempt = int(row.get("attempts") or 1)
    recorded = last_step(lake, row["run_id"])
    steps = [s for s in (recorded, beat_step(run_dir)) if s is not None]
    step = max(steps) if steps else None  # trained steps not yet flushed to the lake count as lost too
    detected = now()
    detail = detail or (f"attempt {attempt} (pid {row.get('pid')} on {row.get('host')}) ended without a word: "
                        "killed or crashed")
    lake.upsert("interruptions", [dict(run_id=row["run_id"], attempt=attempt, cause=cause, detail=detail,
                                       last_step=step, failed_at=failed_at, recorded_at=detected,
                                       detect_s=max(0.0, (detected - failed_at).total_seconds()))])
    lake.upsert("runs", [dict(row, status="interrupted", ended_at=failed_at,
                              error=f"attempt {attempt}: {cause}",
                              interruptions=int(row.get("interruptions") or 0) + 1)])
    return DeadAttempt(row["run_id"], attempt, step, failed_at)


def reconcile(lake: Lake, checkpoints: Path) -> list[DeadAttempt]:
    """Mark every run on this host that says it is running but whose attempt is gone (see `is_dead`)."""
    rows = lake.read("runs", In("status", LIVE)).to_pylist()
    return [mark_dead(lake, r, checkpoints / r["run_id"]) for r in rows if is_dead(r, checkpoints / r["run_id"])]


def record_interruption(lake: Lake, run_id: str, attempt: int, cause: str, detail: str,
                        last_step: int | None) -> None:
    """An attempt that stops itself (a signal, a tripped breaker, non-finite losses, a crash it saw)."""
    t = now()
    lake.upsert("interruptions", [dict(run_id=run_id, attempt=attempt, cause=cause, detail=detail[:4000],
                                       last_step=last_step, failed_at=t, detect_s=0.0, recorded_at=t)])


def close_open_interruptions(lake: Lake, run_id: str, attempt: int, resumed_from: int, saved_at: float,
                             started_at: float, work: tuple[int, float] | None) -> None:
    """When attempt `attempt` starts training (its first step began at `started_at`, from the resume point of step
    `resumed_from` saved at `saved_at`): fill in the costs of every earlier interruption still open. More than one
    is open when attempts died before their first step (killed while starting, or during a resume write before
    training); each row gets its own costs, so none is counted twice:
    - redo_s: the interrupted attempt's training after the resume point, from the later of `saved_at` and when that
      attempt started training (`work`: (attempt, time) of the last attempt that started training, None when not
      recorded: then from `saved_at`); 0 for an attempt that never started training;
    - recover_s: from noticing the failure to the next attempt that trains (`started_at`), or, when the next
      attempt died before training, to that attempt's own failure (the rest is that one's row)."""
    rows = sorted(lake.read("interruptions", EqualTo("run_id", run_id)).to_pylist(), key=lambda r: r["attempt"])
    rows = [r for r in rows if r["attempt"] < attempt]
    for i, row in enumerate(rows):
        if row.get("resumed_from_step") is not None:
            continue  # closed when an earlier attempt started training
        failed = stamp(row["failed_at"])
        detected = failed + (row.get("detect_s") or 0.0)
        recovered = stamp(rows[i + 1]["failed_at"]) if i + 1 < len(rows) else started_at
        if work is None:
            redo = failed - saved_at
        elif work[0] == row["attempt"]:
            redo = failed - max(saved_at, work[1])
        elif work[0] < row["attempt"]:
            redo = 0.0  # it died before training anything
        else:
            redo = failed - saved_at  # a later attempt's record replaced its own: the cost from the resume point
        lost = 0 if row.get("last_step") is None else max(0, row["last_step"] - resumed_from)  # None: no step yet
        lake.upsert("interruptions", [dict(row, resumed_from_step=resumed_from, steps_lost=lost,
                                           redo_s=max(0.0, redo), recover_s=max(0.0, recovered - detected))])


def stamp(t: datetime) -> float:
    """A lake timestamp (UTC, maybe stored naive) as seconds since the epoch."""
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def lost_seconds(lake: Lake, run_id: str) -> float:
    rows = lake.read("interruptions", EqualTo("run_id", run_id)).to_pylist()
    return sum((r.get("redo_s") or 0.0) + (r.get("detect_s") or 0.0) + (r.get("recover_s") or 0.0) for r in rows)


def goodput(wall_s: float, lost_s: float) -> float:
    return 1.0 if wall_s <= 0 else max(0.0, min(1.0, 1.0 - lost_s / wall_s))
