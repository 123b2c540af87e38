"""Periodic evals: a sensor that evaluates every checkpoint as it lands, and a schedule that retries.

Both read the `checkpoints` table and request runs of `checkpoint_eval` (checkpoint x benchmark) that are
still owed, oldest checkpoint first, never more than the eval limit in flight (`jobs/_queue.py`: the
instance's `factory/queue: eval` limit, default 1): catch-up work after a start or a sweep is spread over
later ticks instead of starting at once. The sensor launches each partition once; the schedule (cron from
$FACTORY_EVAL_CRON, default hourly) retries those whose run failed or was canceled.
"""

import os

from dagster import (
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    define_asset_job,
    schedule,
    sensor,
)

from assets.evals import EVAL_EXECUTOR, checkpoint_eval, checkpoints
from jobs._queue import EVAL_TAGS, OwedEval, free_eval_slots, owed_evals
from resources import LakeResource

checkpoint_eval_job = define_asset_job("checkpoint_eval_job", selection=[checkpoint_eval], tags=EVAL_TAGS,
                                       description="Evaluate one checkpoint on one benchmark.",
                                       executor_def=EVAL_EXECUTOR)
EVAL_CRON = os.environ.get("FACTORY_EVAL_CRON", "0 * * * *")


def _request(e: OwedEval, run_key: str | None) -> RunRequest:
    return RunRequest(run_key=run_key, partition_key=e.partition,
                      tags={**EVAL_TAGS, "factory/checkpoint": e.checkpoint})


@sensor(job=checkpoint_eval_job, minimum_interval_seconds=15, default_status=DefaultSensorStatus.RUNNING,
        description="Evaluates each checkpoint on every benchmark once it is recorded, within the eval limit.")
def new_checkpoint_evals(context: SensorEvaluationContext, lake: LakeResource) -> SensorResult:
    lk = lake.lake()
    owed = owed_evals(context.instance, lk, checkpoint_eval_job.name)
    known = set(context.instance.get_dynamic_partitions(checkpoints.name))
    add = list(dict.fromkeys(e.checkpoint for e in owed if e.checkpoint not in known))
    todo = [e for e in owed if not e.attempted][:free_eval_slots(context.instance)]
    return SensorResult(run_requests=[_request(e, f"eval-{e.partition}") for e in todo],
                        dynamic_partitions_requests=[checkpoints.build_add_request(add)] if add else [])


@schedule(job=checkpoint_eval_job, cron_schedule=EVAL_CRON, default_status=DefaultScheduleStatus.RUNNING,
          description="Retries evals whose run failed (cron: $FACTORY_EVAL_CRON), within the eval limit.")
def eval_schedule(context: ScheduleEvaluationContext, lake: LakeResource) -> list[RunRequest]:
    owed = owed_evals(context.instance, lake.lake(), checkpoint_eval_job.name)
    known = set(context.instance.get_dynamic_partitions(checkpoints.name))
    missing = list(dict.fromkeys(e.checkpoint for e in owed if e.checkpoint not in known))
    if missing:  # schedules cannot return partition requests; register them directly
        context.instance.add_dynamic_partitions(checkpoints.name, missing)
    todo = [e for e in owed if not e.running][:free_eval_slots(context.instance)]
    return [_request(e, None) for e in todo]
