"""Preflight on a schedule: the `preflight` job materializes `node_health` (cron from $FACTORY_PREFLIGHT_CRON, default
hourly), skipping a tick while other runs are in progress: their load would be measured, not the node."""

import os

from dagster import (
    DagsterRunStatus,
    DefaultScheduleStatus,
    RunRequest,
    RunsFilter,
    ScheduleEvaluationContext,
    SkipReason,
    define_asset_job,
    schedule,
)

from assets.preflight import node_health
from jobs._ticks import described

preflight_job = define_asset_job("preflight", selection=[node_health],
                                 description="Preflight node tests of this node; results in the node_health table.")
PREFLIGHT_CRON = os.environ.get("FACTORY_PREFLIGHT_CRON", "0 * * * *")
_GOING = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


@schedule(job=preflight_job, cron_schedule=PREFLIGHT_CRON, default_status=DefaultScheduleStatus.RUNNING,
          description=described("Quick preflight of this node (cron: $FACTORY_PREFLIGHT_CRON), skipped while runs are "
                                "going."))
def preflight_schedule(context: ScheduleEvaluationContext) -> RunRequest | SkipReason:
    if os.environ.get("FACTORY_PREFLIGHT", "").strip().lower() == "off":
        return SkipReason("FACTORY_PREFLIGHT=off")
    busy = [r for r in context.instance.get_runs(RunsFilter(statuses=_GOING), limit=20)
            if r.job_name != preflight_job.name]
    if busy:
        return SkipReason(f"{len(busy)} run(s) in progress (e.g. {busy[0].job_name} {busy[0].run_id[:8]}): a "
                          "preflight now would measure their load, not the node")
    return RunRequest()
