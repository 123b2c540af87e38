"""A run's per-step MLflow metrics, logged once per step however many attempts trained it, under names that put
loss and reward first in MLflow's charts (`mlflow_name`).

An attempt that dies has trained (and would have logged) steps past its last resume point; the next attempt trains
them again, and MLflow, which cannot delete a metric point, would then show two points for those steps. So a step's
metrics wait here until a resume point that covers them is about to be written (`flush`, called by the run's
`RunCheckpoints` just before it hands the point to the writer: the loop calls it after the step's `on_step`), and
are dropped when the attempt ends without one (`drop`): those steps will be trained again.

They are logged just before the point is durable, not after, so a kill in between cannot lose them (a resume point
is never newer than the metrics it covers). The converse case, a kill while that point is being written, leaves
logged points for steps the next attempt trains again from an older point: the next attempt reads which of its
steps MLflow already has (`SENTINEL`'s history past its resume point) and does not log them again.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from factory.cockpit.tracking import Tracker

# MLflow's UI draws a run's charts in sections, one per name prefix (`data/skipped` in `data`), sorted by name, with
# the names without a prefix last ("Model metrics", mlflow/server/js: extractChartSectionName); a run's first section
# was then `data`, counters that are zero in most runs, and loss and reward came last. The curves read first are
# logged under `batch/` (their values on the step's batch), which sorts before every other section Factory logs
# (`curriculum/`, `data/`, `eval/`); the rest keep their names.
FIRST_SECTION = "batch"
FIRST = ("reward_mean", "reward_std", "accuracy", "loss", "kl", "entropy")


def mlflow_name(key: str) -> str:
    """A step metric's name in MLflow: `batch/<key>` for the curves read first (FIRST), else `key`."""
    return f"{FIRST_SECTION}/{key}" if key in FIRST else key


# The per-source columns of `step_sources` a step also logs to MLflow, as `source/<name>/<column>`: the sampler/trainer
# gap of each data source (the steps' own gap columns are logged under their names with the rest of the record).
SOURCE_METRICS = ("gap_abs_mean", "gap_kl")


def source_metrics(sources: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The MLflow metrics of a step's `step_sources` rows: `source/<name>/<column>` of SOURCE_METRICS, for the values
    measured (a source without a measured gap logs no point rather than a 0)."""
    return {f"source/{s['source']}/{c}": s[c] for s in sources for c in SOURCE_METRICS if s.get(c) is not None}


SENTINEL = mlflow_name("reward_mean")  # in every step's record: which steps a metric history already holds


class StepMetrics:
    """Per-step metrics held until a resume point covers them, then logged to `mlflow_id` once per step."""

    def __init__(self, tracker: Tracker, mlflow_id: str, resumed_from: int | None = None):
        """`resumed_from`: the step this attempt resumes from (None for a run's first attempt): steps after it that
        MLflow already holds were logged by a dead attempt just before a resume point it never finished."""
        self.tracker, self.mlflow_id = tracker, mlflow_id
        self._pending: dict[int, dict[str, float | None]] = {}
        self._lock = threading.Lock()  # `flush` may be called from the resume writer's thread
        self.logged = 0  # steps logged by this attempt
        self._have: set[int] = set()
        if resumed_from is not None:
            self._have = {s for s, _ in tracker.metric_history(mlflow_id, SENTINEL) if s > resumed_from}

    def add(self, step: int, metrics: Mapping[str, float | None]) -> None:
        """This step's metrics (more may be added for the same step, e.g. its eval), logged at the next `flush`."""
        with self._lock:
            self._pending.setdefault(step, {}).update(metrics)

    def pending(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    def flush(self) -> int:
        """Log every held step (a resume point covering them is about to be written). Returns the steps logged."""
        with self._lock:
            held, self._pending = self._pending, {}
        n = 0
        for step in sorted(held):
            if step in self._have:  # logged by a dead attempt before its unfinished resume point
                continue
            self.tracker.log_metrics(self.mlflow_id, step, {mlflow_name(k): v for k, v in held[step].items()})
            n += 1
        self.logged += n
        return n

    def drop(self) -> list[int]:
        """Forget the held steps (the attempt ends without a resume point covering them); returns them."""
        with self._lock:
            held, self._pending = self._pending, {}
        return sorted(held)
