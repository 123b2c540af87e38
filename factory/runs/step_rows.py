"""A run's per-step rows on their way to the lake: `StepLog` holds the step, rollout, prompt-attempt and
per-source rows not yet written; `forget_after` deletes what a dead attempt recorded past its resume point."""

from __future__ import annotations

from threading import Lock

from pyiceberg.expressions import And, EqualTo, GreaterThan

from factory.core.loop import StepRecord
from factory.lake.writer import Lake
from factory.runs.recovery import now as _now


class StepLog:
    """Step and rollout rows not yet in the lake. Flushed every few steps by the trainer's thread and,
    before each resume point is written, by the writer's thread (with its own Lake: a Lake is per thread),
    so every step a resume point covers is in `steps` by the time the resume point exists."""

    def __init__(self, run_id: str, attempt: int):
        self.run_id, self.attempt = run_id, attempt
        self._lock = Lock()
        self._steps: list[dict] = []
        self._rollouts: list[dict] = []
        self._groups: list[dict] = []
        self._sources: list[dict] = []

    def add(self, r: StepRecord) -> int:
        at = _now()
        with self._lock:
            self._steps.append(dict(run_id=self.run_id, recorded_at=at, attempt=self.attempt, **r.to_dict()))
            self._rollouts.extend(dict(run_id=self.run_id, step=r.step, recorded_at=at, **s) for s in r.samples)
            self._groups.extend(dict(run_id=self.run_id, step=r.step, recorded_at=at, **g) for g in r.groups)
            self._sources.extend(dict(run_id=self.run_id, step=r.step, recorded_at=at, **s) for s in r.sources)
            return len(self._steps)

    def flush(self, lake: Lake) -> None:
        with self._lock:
            steps, rollouts, groups, sources = self._steps, self._rollouts, self._groups, self._sources
            self._steps, self._rollouts, self._groups, self._sources = [], [], [], []
        # Per-step detail first, the step last: a crash in between leaves a step to re-record, never orphan rows.
        for table, rows in (("rollouts", rollouts), ("prompt_attempts", groups), ("step_sources", sources),
                            ("steps", steps)):
            if rows:
                lake.upsert(table, rows)


def forget_after(lake: Lake, run_id: str, step: int) -> None:
    """Delete what a dead attempt recorded past `step` (its successor trains and records those again)."""
    this_run = EqualTo("run_id", run_id)
    for table in ("rollouts", "prompt_attempts", "step_sources", "steps", "checkpoints", "evals"):
        lake.delete(table, And(this_run, GreaterThan("step", step)))
