"""A killed Dagster run worker under the default launcher is noticed and its run retried: a real DagsterInstance with
deploy/dagster.yaml's settings (resources/run_launcher.py's WatchedRunLauncher, run monitoring, run retries), a run of
the quickstart job (its own tags) whose worker is a real process, the daemon's own monitoring step
(`monitor_started_run`) and its own retry decision (`should_retry`).

The same with the settings `make ui` and `make demo` write (factory/ops/instance.py). Launching the retry run, and the
factory run resuming in it, is tests/jobs/test_run_worker_kill.py (a real code server, run worker and training)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dagster import DagsterRunStatus, instance_for_test
from dagster._core.events import EngineEventData
from dagster._core.test_utils import create_run_for_test
from dagster._daemon.auto_run_reexecution.auto_run_reexecution import should_retry
from dagster._daemon.monitoring.run_monitoring import monitor_started_run

from factory.ops.instance import RECOVERY_SETTINGS, instance_settings
from jobs import defs
from resources.run_launcher import WatchedRunLauncher

INSTANCE_YAML = Path(__file__).parents[2] / "deploy" / "dagster.yaml"


@pytest.fixture
def worker():
    """A real process standing in for a run worker: alive until the test kills it."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _started_run(instance, pid: int):
    tags = dict(defs.resolve_job_def("quickstart").tags)
    run = create_run_for_test(instance, job_name="quickstart", status=DagsterRunStatus.STARTED, tags=tags)
    # What the code location server reports when it starts the run's worker (dagster/_grpc/impl.py).
    instance.report_engine_event(f"Started process for run (pid: {pid}).", run, EngineEventData.in_process(pid))
    return run


def _monitor(instance, run_id: str) -> DagsterRunStatus:
    monitor_started_run(instance, None, instance.get_run_record_by_id(run_id), logging.getLogger("test"))
    return instance.get_run_by_id(run_id).status


def test_the_training_jobs_ask_for_run_retries_from_the_failed_step():
    for job in ("quickstart", "sweep_member_job", "sweep_warm_start_job"):
        tags = defs.resolve_job_def(job).tags
        assert tags["dagster/max_retries"] == "2" and tags["dagster/retry_strategy"] == "FROM_FAILURE", job
        # whatever the instance says (the Helm chart cannot set it): a step's own failure is its RetryPolicy's
        assert tags["dagster/retry_on_asset_or_op_failure"] == "false", job


def test_make_ui_and_deploy_write_the_same_recovery_settings():
    deployed = yaml.safe_load(INSTANCE_YAML.read_text())
    assert {k: deployed[k] for k in RECOVERY_SETTINGS} == RECOVERY_SETTINGS == {
        k: v for k, v in instance_settings().items() if k in RECOVERY_SETTINGS}


@pytest.mark.parametrize("settings", ["deploy/dagster.yaml", "factory/ops/instance.py"])
def test_a_killed_run_worker_fails_its_run_and_the_run_is_retried(worker, settings):
    overrides = yaml.safe_load(INSTANCE_YAML.read_text()) if settings == "deploy/dagster.yaml" else instance_settings()
    with instance_for_test(overrides=overrides) as instance:
        assert isinstance(instance.run_launcher, WatchedRunLauncher)
        assert instance.run_monitoring_enabled and instance.run_retries_enabled
        run = _started_run(instance, worker.pid)
        assert _monitor(instance, run.run_id) == DagsterRunStatus.STARTED  # alive: left alone
        worker.kill()
        worker.wait()
        assert _monitor(instance, run.run_id) == DagsterRunStatus.FAILURE
        failed = instance.get_run_by_id(run.run_id)
        assert should_retry(failed, instance)  # the auto re-execution daemon launches a retry of it
        said = [e.dagster_event.message for e in instance.all_logs(run.run_id) if e.dagster_event]
        assert any(f"run worker process {worker.pid} is gone" in (m or "") for m in said)


def test_a_process_that_reuses_the_pid_later_is_not_the_worker(worker):
    from resources.run_launcher import WorkerStatus, pid_health

    assert pid_health(worker.pid, recorded_at=0.0).status == WorkerStatus.FAILED  # started after "the event"
    assert pid_health(worker.pid, recorded_at=1e12).status == WorkerStatus.RUNNING
