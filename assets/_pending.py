"""Which periodic evals (partitions of `checkpoint_eval`: a recorded checkpoint on a benchmark of its task) recorded
checkpoints still owe, and which are done: read by the eval sensors (what to launch and which partitions to add,
jobs/_queue.py), the summarizer (when to summarize again) and the sweep summary (what it says is pending).

`EvalProgress.version` names the set of evals done for a group of runs: a summary drawn from that set is that
version of the summary, so the summarizer materializes it again exactly when the set changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dagster import AssetKey, DagsterInstance

from factory.envs.eval_suites import applicable_benchmarks
from factory.runs.checkpoint_eval import checkpoint_key, eval_key, parse_eval_key

CHECKPOINT_EVAL = AssetKey("checkpoint_eval")


@dataclass(frozen=True)
class Owed:
    partition: str  # <benchmark>|<run_id>@<step> (runs/checkpoint_eval.py eval_key)
    checkpoint: str  # <run_id>@<step>
    recorded_at: datetime


@dataclass(frozen=True)
class EvalProgress:
    """The evals of some runs' recorded checkpoints: done and pending (`checkpoint x benchmark`, oldest first)."""

    done: tuple[str, ...]
    pending: tuple[str, ...]

    @property
    def version(self) -> str:
        """A short digest of the set of evals done (the same set, the same version)."""
        return hashlib.sha256("\n".join(sorted(self.done)).encode()).hexdigest()[:12]

    def text(self, limit: int = 20) -> str:
        """`none`, or the count and the pending evals, e.g. `2: run-a@100 x heldout, run-a@100 x carry_chains`."""
        if not self.pending:
            return "none"
        shown = ", ".join(self.pending[:limit])
        more = f", and {len(self.pending) - limit} more" if len(self.pending) > limit else ""
        return f"{len(self.pending)}: {shown}{more}"


def label(partition: str) -> str:
    """`<run_id>@<step> x <benchmark>`: how an eval is named to people."""
    checkpoint, benchmark = parse_eval_key(partition)
    return f"{checkpoint} x {benchmark}"


def keys(lake: Any) -> list[str]:
    """Every partition of `checkpoint_eval` the recorded checkpoints have (each on the benchmarks of its run's
    task), oldest checkpoint first: what the eval sensors register."""
    return [o.partition for o in _owed_or_done(lake, None)]


def owed(instance: DagsterInstance, lake: Any, run_ids: set[str] | None = None) -> list[Owed]:
    """Every (recorded checkpoint, applicable benchmark) of `checkpoint_eval` not materialized yet, oldest
    checkpoint first; only of `run_ids` when given. `lake` is a `factory.lake.Lake`."""
    return _split(instance, lake, run_ids)[1]


def progress(instance: DagsterInstance, lake: Any, run_ids: set[str]) -> EvalProgress:
    """The evals of `run_ids`' recorded checkpoints, done and pending."""
    done, pending = _split(instance, lake, run_ids)
    return EvalProgress(done=tuple(sorted(done)), pending=tuple(label(o.partition) for o in pending))


def _split(instance: DagsterInstance, lake: Any, run_ids: set[str] | None) -> tuple[list[str], list[Owed]]:
    evals = _owed_or_done(lake, run_ids)
    if not evals:
        return [], []
    materialized = {str(k) for k in instance.get_materialized_partitions(CHECKPOINT_EVAL)}
    done = [label(o.partition) for o in evals if o.partition in materialized]
    return done, [o for o in evals if o.partition not in materialized]


def _owed_or_done(lake: Any, run_ids: set[str] | None) -> list[Owed]:
    """Every eval the recorded checkpoints (of `run_ids`, when given) have, oldest checkpoint first."""
    rows = lake.read("checkpoints").select(["run_id", "step", "recorded_at"]).to_pylist()
    if run_ids is not None:
        rows = [r for r in rows if r["run_id"] in run_ids]
    if not rows:
        return []
    tasks = _task_names(lake)
    return [Owed(eval_key(ckpt, bench), ckpt, r["recorded_at"])
            for r in sorted(rows, key=lambda r: (r["recorded_at"], r["run_id"], r["step"]))
            for ckpt in [checkpoint_key(r["run_id"], r["step"])]
            for bench in applicable_benchmarks(tasks.get(r["run_id"], "arithmetic"))]


def _task_names(lake: Any) -> dict[str, str]:
    """run_id -> task family, from each run's spec (a run of another family is not scored on arithmetic suites)."""
    rows = lake.read("runs").select(["run_id", "spec"]).to_pylist()
    return {r["run_id"]: json.loads(r["spec"]).get("task", {}).get("name", "arithmetic") for r in rows}


__all__ = ["EvalProgress", "Owed", "keys", "label", "owed", "progress"]
