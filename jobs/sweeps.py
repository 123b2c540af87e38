"""The `sweep` job (launched from the launchpad) and the sensors that run its members and summarize it.

`sweep` validates every member spec first; a bad axis fails the run with the axis named and nothing is
written or launched. A valid sweep is written under FACTORY_HOME/sweeps/<sweep_id>/, its members become
partitions of `sweep_member_run`, one `sweeps` row each (queued) and an MLflow parent run. The
`sweep_launcher` sensor then queues one run per member (tags: sweep id, member, lane); the run queue's
lane limit keeps at most `max_concurrent` of a sweep running. `sweep_summarizer` materializes the
sweep's summary once every member has ended.
"""

import json
from datetime import UTC, datetime
from typing import Any, Literal

from dagster import (
    Config,
    DefaultSensorStatus,
    Failure,
    MetadataValue,
    OpExecutionContext,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    define_asset_job,
    in_process_executor,
    job,
    op,
    sensor,
)
from pydantic import Field

from assets.sweeps import sweep_member_run, sweep_members, sweep_summary, sweeps
from factory.config import SpecError, parse_overrides
from factory.sweep import SweepDefinition, SweepError, plan_sweep, read_sweep, sweep_dir, write_sweep
from resources import FactoryHomeResource, LakeResource, MlflowResource

sweep_member_job = define_asset_job("sweep_member_job", selection=[sweep_member_run],
                                    description="One sweep member's training run (queued by sweep_launcher).")
sweep_summary_job = define_asset_job("sweep_summary_job", selection=[sweep_summary],
                                     description="A finished sweep's summary (queued by sweep_summarizer).")


class SweepConfig(Config):
    """A sweep: a base spec, axes over its fields, grid or random. Every member is validated before any launches."""

    name: str = Field("sweep", description="names the sweep and its MLflow parent run")
    base_spec: str = Field("examples/quickstart.yaml", description="path of the base spec (YAML)")
    base_inline: dict[str, Any] | None = Field(None, description="the base spec inline (replaces base_spec)")
    overrides: list[str] = Field(default_factory=list,
                                 description="path=value (YAML value) for every member, e.g. 'schedule.steps=50'")
    axes: dict[str, list[Any]] = Field(
        default_factory=dict, description="field path -> values, e.g. {'algorithm.lr': [1e-5, 3e-5], 'seed': [0, 1]}")
    mode: Literal["grid", "random"] = Field("grid", description="grid: every combination; random: `samples` of them")
    samples: int | None = Field(None, description="random mode: how many members (default: all)")
    seed: int = Field(0, description="random mode: which members are drawn")
    max_concurrent: int = Field(2, description="members of this sweep running at once")


@op(description="Validate every member, then record the sweep and queue its members (through the sensor).")
def plan_and_queue_sweep(context: OpExecutionContext, config: SweepConfig, home: FactoryHomeResource,
                         lake: LakeResource, mlflow: MlflowResource) -> dict:
    try:
        fields = config.model_dump()
        fields["overrides"] = parse_overrides(config.overrides)
        plan = plan_sweep(SweepDefinition(**fields))
    except (SweepError, SpecError, ValueError) as e:
        raise Failure(description=str(e), metadata={"nothing_launched": True}) from e
    paths = home.paths()
    tracker = mlflow.tracker()
    parent = tracker.start_run(experiment=config.name, run_name=plan.sweep_id,
                               params={"sweep": config.model_dump(mode="json")},
                               tags={"factory.sweep_id": plan.sweep_id, "factory.members": len(plan.members)})
    now = datetime.now(UTC)
    lake.lake().upsert("sweeps", [dict(sweep_id=plan.sweep_id, member=m.key, name=config.name,
                                       axes=json.dumps(m.values, sort_keys=True), spec=m.spec.to_json(),
                                       status="queued", mlflow_parent_run_id=parent, created_at=now, recorded_at=now)
                                  for m in plan.members])
    context.instance.add_dynamic_partitions(sweep_members.name, [m.key for m in plan.members])
    context.instance.add_dynamic_partitions(sweeps.name, [plan.sweep_id])
    # Last: the stored plan is what the launcher sensor reacts to, so its partitions must exist by then.
    write_sweep(plan, paths, extra={"mlflow_parent_run_id": parent})
    context.add_output_metadata({"sweep_id": plan.sweep_id, "members": len(plan.members),
                                 "max_concurrent": config.max_concurrent, "mlflow_parent_run_id": parent,
                                 "members_table": MetadataValue.md(_members_md(plan))})
    context.log.info(f"sweep {plan.sweep_id}: {len(plan.members)} members queued, {config.max_concurrent} at a time")
    return {"sweep_id": plan.sweep_id, "members": [m.key for m in plan.members]}


def _members_md(plan) -> str:
    axes = list(plan.definition.axes)
    head = "| member | " + " | ".join(axes) + " |\n|---|" + "---|" * len(axes)
    return head + "\n" + "\n".join(f"| {m.key} | " + " | ".join(str(m.values[a]) for a in axes) + " |"
                                   for m in plan.members)


@job(description="Launch a sweep: a base spec and axes over its fields; members run as their own runs.",
     tags={"factory/kind": "sweep"}, executor_def=in_process_executor)  # one op: no step process to start
def sweep():
    plan_and_queue_sweep()


def _sweep_ids(home: FactoryHomeResource) -> list[str]:
    root = home.paths().root / "sweeps"
    return sorted(p.name for p in root.iterdir() if (p / "sweep.json").is_file()) if root.is_dir() else []


@sensor(job=sweep_member_job, minimum_interval_seconds=1, default_status=DefaultSensorStatus.RUNNING,
        description="Queues one run per member of each new sweep; the run queue's lanes cap its concurrency.")
def sweep_launcher(context: SensorEvaluationContext, home: FactoryHomeResource) -> SensorResult:
    launched = set(json.loads(context.cursor)) if context.cursor else set()
    requests = []
    for sweep_id in _sweep_ids(home):
        if sweep_id in launched:
            continue
        info = read_sweep(home.paths(), sweep_id)
        # run_key = member key: Dagster never launches the same key twice, even if the cursor is lost.
        requests += [RunRequest(run_key=m["key"], partition_key=m["key"],
                                tags={"factory/sweep_id": sweep_id, "factory/member": m["key"],
                                      "factory/lane": m["lane"]}) for m in info["members"]]
        launched.add(sweep_id)
    return SensorResult(run_requests=requests, cursor=json.dumps(sorted(launched)))


@sensor(job=sweep_summary_job, minimum_interval_seconds=10, default_status=DefaultSensorStatus.RUNNING,
        description="Summarizes a sweep once every member has succeeded or failed.")
def sweep_summarizer(context: SensorEvaluationContext, home: FactoryHomeResource,
                     lake: LakeResource) -> SensorResult:
    done = set(json.loads(context.cursor)) if context.cursor else set()
    pending = [s for s in _sweep_ids(home) if s not in done]
    if not pending:
        return SensorResult(run_requests=[], cursor=json.dumps(sorted(done)))
    rows = lake.lake().read("sweeps").select(["sweep_id", "status"]).to_pylist()
    requests = []
    for sweep_id in pending:
        statuses = [r["status"] for r in rows if r["sweep_id"] == sweep_id]
        n = len(read_sweep(home.paths(), sweep_id)["members"])
        if len(statuses) == n and all(s in ("succeeded", "failed") for s in statuses):
            requests.append(RunRequest(run_key=f"summary-{sweep_id}", partition_key=sweep_id,
                                       tags={"factory/sweep_id": sweep_id}))
            done.add(sweep_id)
    return SensorResult(run_requests=requests, cursor=json.dumps(sorted(done)))


__all__ = ["SweepConfig", "sweep", "sweep_dir", "sweep_launcher", "sweep_member_job", "sweep_summarizer",
           "sweep_summary_job"]
