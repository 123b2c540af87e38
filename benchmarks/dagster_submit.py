"""Submitting a run of one asset job as the UI's Launch button (or a sensor's RunRequest) does: through the code
server of a workspace, onto the instance's run queue. Shared by `benchmarks/periodic_evals.py` and
`tests/jobs/test_run_worker_kill.py`, which need the real run-worker path rather than `materialize`."""

from __future__ import annotations

from typing import Any


def submit_as_the_ui(instance: Any, wpc: Any, job_name: str, asset: str, run_config: dict[str, Any],
                     tags: dict[str, str] | None = None) -> Any:
    """Create and submit a run of `job_name` (selecting asset `asset`) from the code location `factory` of the
    workspace process context `wpc`; the run's tags are the job's plus `tags`. Returns the DagsterRun."""
    from dagster import AssetKey, DagsterRunStatus
    from dagster._core.definitions.selector import JobSubsetSelector

    ctx = wpc.create_request_context()
    location = ctx.get_code_location("factory")
    (repo,) = location.get_repositories().values()
    job = location.get_job(JobSubsetSelector(location_name="factory", repository_name=repo.name, job_name=job_name,
                                             op_selection=None, asset_selection=[AssetKey(asset)]))
    plan = location.get_execution_plan(job, run_config, step_keys_to_execute=None, known_state=None,
                                       instance=instance)
    run = instance.create_run(
        job_name=job_name, run_id=None, run_config=run_config, status=DagsterRunStatus.NOT_STARTED,
        tags={**job.tags, **(tags or {})}, root_run_id=None, parent_run_id=None, step_keys_to_execute=None,
        execution_plan_snapshot=plan.execution_plan_snapshot, job_snapshot=job.job_snapshot,
        parent_job_snapshot=job.parent_job_snapshot, asset_selection=job.asset_selection,
        asset_check_selection=job.asset_check_selection, resolved_op_selection=None, op_selection=None,
        remote_job_origin=job.get_remote_origin(), job_code_origin=job.get_python_origin(),
        asset_graph=ctx.asset_graph)
    instance.submit_run(run.run_id, ctx)
    return run
