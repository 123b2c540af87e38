"""What the sensors ask the Dagster instance before they launch: runs in flight, the eval and summary limits, evals
still owed.

Limits are enforced here, by the sensors, so they hold on any instance (whatever its run queue says):
a sweep never has more than `max_concurrent` runs in flight, evals never more than the eval limit, and sweep
summaries never more than the summary limit (1). Evals and summaries are separate queues: a summary is light (lake
reads, matplotlib, MLflow artifacts; no model), so it does not wait behind a model eval, and evals never wait for
it. The limits are read from the instance's run queue (`factory.ops.instance`, tags `factory/queue: eval` and
`factory/queue: summary`), so an operator sets them in one place, `dagster.yaml`.

A run that failed and that Dagster's run retries will re-execute (a killed run worker: `dagster/will_retry`, or the
instance's retry policy while that tag is not written yet) still holds its slot until its retry exists or its
retries are spent (`holds_slot`): else a slot freed for the seconds between the failure and the retry's creation
would start another run beside the retry.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter
from dagster._core.events import RunFailureReason
from dagster._core.execution.retries import auto_reexecution_should_retry_run
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, RUN_FAILURE_REASON_TAG, WILL_RETRY_TAG
from dagster._utils.tags import get_boolean_tag_value

from assets import _pending as pending
from factory.ops.instance import (
    DEFAULT_MAX_CONCURRENT_EVALS,
    EVAL_QUEUE,
    MAX_CONCURRENT_SUMMARIES,
    QUEUE_TAG,
    SUMMARY_QUEUE,
    queue_limit_from,
)

IN_FLIGHT = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
EVAL_TAGS = {QUEUE_TAG: EVAL_QUEUE}
SUMMARY_TAGS = {QUEUE_TAG: SUMMARY_QUEUE}
PARTITION_TAG = "dagster/partition"


def in_flight(instance: DagsterInstance, tags: dict[str, str]) -> int:
    """How many runs with these tags are queued or running."""
    return instance.get_runs_count(RunsFilter(tags=tags, statuses=IN_FLIGHT))


def awaiting_retry(instance: DagsterInstance, run: DagsterRun) -> bool:
    """Whether `run` failed and Dagster's run retries will re-execute it, and that retry does not exist yet."""
    if run.status != DagsterRunStatus.FAILURE or run.tags.get(AUTO_RETRY_RUN_ID_TAG):
        return False
    will = run.tags.get(WILL_RETRY_TAG)
    if will is not None:
        return get_boolean_tag_value(will, default_value=False)
    if not instance.run_retries_enabled:
        return False
    # The failure is stored before its `dagster/will_retry` tag: decide as the instance is about to.
    reason = run.tags.get(RUN_FAILURE_REASON_TAG)
    try:
        return auto_reexecution_should_retry_run(instance, run, RunFailureReason(reason) if reason else None)
    except ValueError:  # an unknown failure reason: Dagster reads it as UNKNOWN
        return auto_reexecution_should_retry_run(instance, run, RunFailureReason.UNKNOWN)


def holds_slot(instance: DagsterInstance, run: DagsterRun) -> bool:
    """Queued, running, or failed and awaiting its automatic retry (`awaiting_retry`)."""
    return run.status in IN_FLIGHT or awaiting_retry(instance, run)


def _queue_limit(instance: DagsterInstance, queue: str, default: int) -> int:
    config = instance.get_concurrency_config().run_queue_config
    return queue_limit_from(config.tag_concurrency_limits if config else None, queue, default)


def eval_limit(instance: DagsterInstance) -> int:
    """Evals at once: the instance's run-queue limit for `factory/queue: eval`, else 1."""
    return _queue_limit(instance, EVAL_QUEUE, DEFAULT_MAX_CONCURRENT_EVALS)


def free_eval_slots(instance: DagsterInstance) -> int:
    return max(0, eval_limit(instance) - in_flight(instance, EVAL_TAGS))


def summary_limit(instance: DagsterInstance) -> int:
    """Sweep summaries at once: the instance's run-queue limit for `factory/queue: summary`, else 1."""
    return _queue_limit(instance, SUMMARY_QUEUE, MAX_CONCURRENT_SUMMARIES)


def free_summary_slots(instance: DagsterInstance) -> int:
    return max(0, summary_limit(instance) - in_flight(instance, SUMMARY_TAGS))


@dataclass(frozen=True)
class OwedEval:
    partition: str  # <benchmark>|<run_id>@<step>: a partition of checkpoint_eval
    checkpoint: str  # <run_id>@<step>
    recorded_at: datetime
    attempted: bool  # a run was launched for it before (it failed or was canceled); retried by the schedule
    running: bool  # a run for it is queued or running


def owed_evals(instance: DagsterInstance, lake, job_name: str, run_ids: set[str] | None = None) -> list[OwedEval]:
    """Every (recorded checkpoint, applicable benchmark) of `checkpoint_eval` not materialized yet, oldest
    checkpoint first; only of `run_ids` when given."""
    owed = pending.owed(instance, lake, run_ids)
    if not owed:
        return []
    runs = instance.get_runs(RunsFilter(job_name=job_name))
    running = {r.tags.get(PARTITION_TAG) for r in runs if r.status in IN_FLIGHT}
    attempted = {r.tags.get(PARTITION_TAG) for r in runs}
    return [OwedEval(o.partition, o.checkpoint, o.recorded_at, o.partition in attempted, o.partition in running)
            for o in owed]


__all__ = ["EVAL_TAGS", "IN_FLIGHT", "SUMMARY_TAGS", "OwedEval", "awaiting_retry", "eval_limit", "free_eval_slots",
           "free_summary_slots", "holds_slot", "in_flight", "owed_evals", "summary_limit"]
