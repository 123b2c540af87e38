"""Periodic evals: a sensor that evaluates every checkpoint as it lands, and a schedule that catches up.

Both read the `checkpoints` table, register new checkpoints as partitions of `checkpoint_eval`, and
request one run per (checkpoint, benchmark) not yet evaluated. The sensor reacts within its interval;
the schedule (cron from $FACTORY_EVAL_CRON, default hourly) evaluates whatever the sensor missed
(it was stopped, a run failed, a benchmark was added).
"""

import json
import os

from dagster import (
    AssetKey,
    DagsterRunStatus,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    MultiPartitionKey,
    RunRequest,
    RunsFilter,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    define_asset_job,
    schedule,
    sensor,
)

from assets.evals import checkpoint_eval, checkpoints
from factory.checkpoint_eval import checkpoint_key, parse_checkpoint_key
from factory.envs.benchmarks import applicable_benchmarks
from resources import LakeResource

checkpoint_eval_job = define_asset_job("checkpoint_eval_job", selection=[checkpoint_eval],
                                       description="Evaluate one checkpoint on one benchmark.")
EVAL_CRON = os.environ.get("FACTORY_EVAL_CRON", "0 * * * *")
_ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
           DagsterRunStatus.STARTED]


def _partition(ckpt: str, benchmark: str) -> MultiPartitionKey:
    return MultiPartitionKey({"checkpoint": ckpt, "benchmark": benchmark})


def _task_names(lake) -> dict[str, str]:
    """run_id -> task family, from each run's spec (a run of another family is not scored on arithmetic suites)."""
    rows = lake.read("runs").select(["run_id", "spec"]).to_pylist()
    return {r["run_id"]: json.loads(r["spec"]).get("task", {}).get("name", "arithmetic") for r in rows}


def _requests(keys: list[str], skip: set[str], tasks: dict[str, str]) -> list[RunRequest]:
    out = []
    for k in keys:
        for b in applicable_benchmarks(tasks.get(parse_checkpoint_key(k)[0], "arithmetic")):
            pk = _partition(k, b)
            if str(pk) not in skip:
                out.append(RunRequest(run_key=f"eval-{pk}", partition_key=pk, tags={"factory/checkpoint": k}))
    return out


@sensor(job=checkpoint_eval_job, minimum_interval_seconds=15, default_status=DefaultSensorStatus.RUNNING,
        description="Evaluates each checkpoint on every benchmark as soon as it is recorded.")
def new_checkpoint_evals(context: SensorEvaluationContext, lake: LakeResource) -> SensorResult:
    since = context.cursor or ""
    rows = lake.lake().read("checkpoints").select(["run_id", "step", "recorded_at"]).to_pylist()
    new = sorted((r["recorded_at"].isoformat(), checkpoint_key(r["run_id"], r["step"])) for r in rows
                 if r["recorded_at"].isoformat() > since)
    if not new:
        return SensorResult(run_requests=[], cursor=since)
    keys = list(dict.fromkeys(k for _, k in new))
    known = set(context.instance.get_dynamic_partitions(checkpoints.name))
    add = [k for k in keys if k not in known]
    return SensorResult(run_requests=_requests(keys, set(), _task_names(lake.lake())),
                        dynamic_partitions_requests=[checkpoints.build_add_request(add)] if add else [],
                        cursor=new[-1][0])


@schedule(job=checkpoint_eval_job, cron_schedule=EVAL_CRON, default_status=DefaultScheduleStatus.RUNNING,
          description="Evaluates every recorded checkpoint x benchmark not evaluated yet (cron: $FACTORY_EVAL_CRON).")
def eval_schedule(context: ScheduleEvaluationContext, lake: LakeResource) -> list[RunRequest]:
    rows = lake.lake().read("checkpoints").select(["run_id", "step"]).to_pylist()
    keys = sorted({checkpoint_key(r["run_id"], r["step"]) for r in rows})
    known = set(context.instance.get_dynamic_partitions(checkpoints.name))
    missing = [k for k in keys if k not in known]
    if missing:  # schedules cannot return partition requests; register them directly
        context.instance.add_dynamic_partitions(checkpoints.name, missing)
    done = {str(k) for k in context.instance.get_materialized_partitions(AssetKey("checkpoint_eval"))}
    active = {r.dagster_run.tags.get("dagster/partition") for r in context.instance.get_run_records(
        RunsFilter(job_name=checkpoint_eval_job.name, statuses=_ACTIVE))}
    return _requests(keys, done | {a for a in active if a}, _task_names(lake.lake()))
