"""Periodic evals: a sensor that evaluates every checkpoint as it lands, and a schedule that retries.

Both read the `checkpoints` table, register a partition of `checkpoint_eval` per checkpoint and benchmark of its
task (`<benchmark>|<run_id>@<step>`), and request runs of those still owed, oldest checkpoint first, never more
than the eval limit in flight (`jobs/_queue.py`: the instance's `factory/queue: eval` limit, default 1): catch-up
work after a start or a sweep is spread over later ticks instead of starting at once. Sweep summaries have a queue
of their own (`factory/queue: summary`): evals never wait for them, nor they for evals. The sensor launches each
partition once; the schedule (cron from $FACTORY_EVAL_CRON, default hourly) retries those whose run failed or was
canceled. Both say why when they start nothing.
"""

import os

from dagster import (
    DagsterInstance,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    schedule,
    sensor,
)

from assets import _pending as pending
from assets.evals import EVAL_EXECUTOR, checkpoint_eval, checkpoint_evals
from jobs._queue import EVAL_TAGS, OwedEval, eval_limit, free_eval_slots, in_flight, owed_evals
from jobs._ticks import described
from resources import LakeResource

checkpoint_eval_job = define_asset_job("checkpoint_eval_job", selection=[checkpoint_eval], tags=EVAL_TAGS,
                                       description="Evaluate one checkpoint on one benchmark.",
                                       executor_def=EVAL_EXECUTOR)
EVAL_CRON = os.environ.get("FACTORY_EVAL_CRON", "0 * * * *")


def _request(e: OwedEval, run_key: str | None) -> RunRequest:
    return RunRequest(run_key=run_key, partition_key=e.partition,
                      tags={**EVAL_TAGS, "factory/checkpoint": e.checkpoint})


@sensor(job=checkpoint_eval_job, minimum_interval_seconds=15, default_status=DefaultSensorStatus.RUNNING,
        description=described("Evaluates each checkpoint on the benchmarks of its task once it is recorded, within "
                              "the eval limit."))
def new_checkpoint_evals(context: SensorEvaluationContext, lake: LakeResource) -> SensorResult:
    lk = lake.lake()
    instance = context.instance
    owed = owed_evals(instance, lk, checkpoint_eval_job.name)
    add = _unregistered(instance, lk)
    partitions = [checkpoint_evals.build_add_request(add)] if add else []
    fresh = [e for e in owed if not e.attempted]
    todo = fresh[:free_eval_slots(instance)]
    if todo:
        return SensorResult(run_requests=[_request(e, f"eval-{e.partition}") for e in todo],
                            dynamic_partitions_requests=partitions)
    return SensorResult(dynamic_partitions_requests=partitions, skip_reason=_why_none(instance, owed, fresh))


def _unregistered(instance: DagsterInstance, lake) -> list[str]:
    """The evals of recorded checkpoints (each on the benchmarks of its task) not yet partitions of checkpoint_eval,
    done ones included: those materialized before the partitions were per checkpoint's benchmark get theirs too."""
    known = set(instance.get_dynamic_partitions(checkpoint_evals.name))
    return [k for k in pending.keys(lake) if k not in known]


def _why_none(instance: DagsterInstance, owed: list[OwedEval], fresh: list[OwedEval]) -> str:
    """Why no eval starts this tick, in words (shown on the sensor's tick in the UI)."""
    if not owed:
        return "no checkpoint owes an eval"
    if not fresh:
        failed = sum(not e.running for e in owed)
        return (f"{len(owed)} eval(s) owed, every one launched ({len(owed) - failed} running, {failed} failed or "
                f"canceled: eval_schedule retries those, cron {EVAL_CRON!r})")
    running, limit = in_flight(instance, EVAL_TAGS), eval_limit(instance)
    return f"eval limit {limit} reached: {running} running; {len(fresh)} eval(s) wait"


@schedule(job=checkpoint_eval_job, cron_schedule=EVAL_CRON, default_status=DefaultScheduleStatus.RUNNING,
          description=described("Retries evals whose run failed (cron: $FACTORY_EVAL_CRON), within the eval limit."))
def eval_schedule(context: ScheduleEvaluationContext, lake: LakeResource) -> list[RunRequest] | SkipReason:
    lk = lake.lake()
    owed = owed_evals(context.instance, lk, checkpoint_eval_job.name)
    missing = _unregistered(context.instance, lk)
    if missing:  # schedules cannot return partition requests; register them directly
        context.instance.add_dynamic_partitions(checkpoint_evals.name, missing)
    retry = [e for e in owed if not e.running]
    todo = retry[:free_eval_slots(context.instance)]
    if todo:
        return [_request(e, None) for e in todo]
    return SkipReason(_why_none(context.instance, owed, retry) if retry else
                      "no eval to retry" if not owed else f"{len(owed)} eval(s) owed, all running")
