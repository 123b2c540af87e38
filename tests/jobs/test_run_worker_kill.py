"""The run worker of a training run killed for real, and recovery that Dagster itself sees: a real instance in a temp
DAGSTER_HOME with Factory's own settings (factory/ops/instance.py, as `make ui` writes them), the real code location
(workspace.yaml, served by a code server process), a run of the quickstart job's `grpo_run` launched through the run
queue onto a run worker process, whose step trains in a child process as Dagster's multiprocess executor runs it.

The test SIGKILLs the run worker mid-training and sees: the trainer (the orphaned step process) stop at a resume
point on its own (cause `supervisor_lost`); Dagster mark the run failed; one iteration each of Dagster's own daemons
(run monitoring, auto re-execution, the run queue) re-execute it from the failure; the retry resume the same factory
run (same run_id, attempt 2, from the step the trainer stopped at, no step trained twice); and the retry's page say
so (a warning and an AssetObservation with the cause and the steps), not only a stack trace.

The daemons are driven one iteration at a time rather than run as a process: what they do is the same, and the test
decides when."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterEventType, DagsterInstance, DagsterRunStatus, materialize
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG
from dagster._core.test_utils import create_test_daemon_workspace_context
from dagster._core.workspace.load_target import WorkspaceFileTarget
from dagster._daemon.auto_run_reexecution.auto_run_reexecution import consume_new_runs_for_automatic_reexecution
from dagster._daemon.monitoring.run_monitoring import execute_run_monitoring_iteration
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

from benchmarks.dagster_submit import submit_as_the_ui
from factory.home import factory_home
from factory.lake import Lake
from factory.ops.instance import ensure_instance_yaml
from factory.runs.attempt import LOCK, AttemptLock, beat_step
from resources.run_launcher import _process_start, worker_pid
from tests.polling import wait_for as poll

ROOT = Path(__file__).resolve().parents[2]
SPEC = str(ROOT / "examples" / "quickstart.yaml")
OVERRIDES = ["name=killrw", "model.preset=micro", "task.n_train=200", "task.n_eval=16", "sft.steps=10",
             "sft.stop_at_accuracy=null", "rollout.prompts_per_step=4", "algorithm.group_size=2", "schedule.steps=8",
             "schedule.eval_pass_k=2", "ops.resume_every=2", "trainer.threads=1", "ops.preflight=off"]
LOG = logging.getLogger("test_run_worker_kill")


def wait_for(what: str, ready):
    return poll(what, ready, limit_s=600.0, every_s=0.1)  # a Dagster run on a loaded CI machine: minutes


FINISHED = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


def _alive(pid: int) -> bool:
    return _process_start(pid) is not None  # a zombie counts as gone


def _launch_grpo_run(instance: DagsterInstance, wpc):
    """A run of the quickstart job with only `grpo_run` selected, created as the launchpad would and submitted to
    the run queue."""
    run_config = {"resources": {"spec": {"config": {"path": SPEC, "overrides": OVERRIDES}}}}
    return submit_as_the_ui(instance, wpc, "quickstart", "grpo_run", run_config)


def _dequeue(wpc) -> None:
    """One iteration of the run queue's daemon: queued runs are launched onto run workers."""
    list(QueuedRunCoordinatorDaemon(interval_seconds=1).run_iteration(wpc))


def _status(instance: DagsterInstance, run_id: str) -> DagsterRunStatus:
    return instance.get_run_by_id(run_id).status


@pytest.fixture
def dagster_home(tmp_path, monkeypatch):
    """FACTORY_HOME and DAGSTER_HOME under tmp_path, Factory's instance settings, and each weight publish held 0.4 s
    (a fault point's window: infra/faults.py) so the run worker dies mid-run. Set before the code server starts:
    it and every process it starts inherit them."""
    home = tmp_path / "home"
    monkeypatch.setenv("FACTORY_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("FACTORY_FAULT_DIR", str(tmp_path / "faults"))
    monkeypatch.setenv("FACTORY_FAULT_HOLD_S", "publish:0.4")
    ensure_instance_yaml(tmp_path / "dagster")
    return home


@pytest.mark.slow
def test_a_killed_run_worker_is_failed_retried_and_its_factory_run_resumes(dagster_home):
    from jobs import QUICKSTART_ASSETS, make_resources

    home = dagster_home
    with DagsterInstance.get() as instance:
        assert instance.run_monitoring_enabled and instance.run_retries_enabled
        # The warm start, in this process: the Dagster run under test trains only GRPO (its inputs are these).
        warm = materialize(QUICKSTART_ASSETS[:2], resources=make_resources(SPEC, OVERRIDES, str(home)),
                           instance=instance)
        assert warm.success
        target = WorkspaceFileTarget(paths=[str(ROOT / "workspace.yaml")])
        with create_test_daemon_workspace_context(target, instance) as wpc:
            run = _launch_grpo_run(instance, wpc)
            _dequeue(wpc)
            run_dir = factory_home(home).checkpoints / f"killrw-{run.run_id[:8]}"
            # Past the first resume point (step 2): the worker dies while its step process trains step 3 or later.
            wait_for("step 3", lambda: _status(instance, run.run_id) == DagsterRunStatus.STARTED
                      and (beat_step(run_dir) or 0) >= 3)
            worker, _ = worker_pid(instance, run.run_id)
            trainer = int((run_dir / LOCK).read_text())
            assert trainer != worker  # the step trains in its own process, a child of the worker
            os.kill(worker, signal.SIGKILL)

            # The orphaned trainer notices at its next step, writes a resume point and exits (releasing its lock).
            wait_for("the orphaned trainer to stop", lambda: not AttemptLock.is_held(run_dir) and not _alive(trainer))
            with Lake.open(factory_home(home)) as lake:
                (row,) = lake.read("runs").to_pylist()
                (cut,) = lake.read("interruptions").to_pylist()
                stopped_at = max(lake.read("steps").column("step").to_pylist())
            assert row["status"] == "interrupted" and cut["cause"] == "supervisor_lost", row
            assert 3 <= stopped_at < 8
            assert sorted(p.name for p in (run_dir / "resume").iterdir())[-1] == f"step-{stopped_at:06d}"

            # Dagster marks the run failed (its code server sees the worker's exit; run monitoring would, else).
            list(execute_run_monitoring_iteration(wpc, LOG))
            wait_for("the run to be marked failed", lambda: _status(instance, run.run_id) == DagsterRunStatus.FAILURE)
            said = " ".join(e.dagster_event.message or "" for e in instance.all_logs(run.run_id) if e.dagster_event)
            # The code server's word: it started the worker and checks it every 0.5 s, long before the trainer stops,
            # so run monitoring finds the run failed already (its own check, WatchedRunLauncher's, is
            # tests/jobs/test_run_worker_retries.py: the one that matters where the code server is gone too).
            assert f"Run execution process for {run.run_id} was terminated by signal 9 (SIGKILL)" in said, said
            # and the orphaned step's own, in the same run's log: why the trainer stopped, and what resumes it
            stopped = [e.dagster_event.step_failure_data.user_failure_data.description or "" for e in
                       instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_FAILURE)
                       if e.dagster_event.step_failure_data.user_failure_data]
            assert any(f"the run worker (pid {worker}) is gone: training stopped at a resume point" in d
                       for d in stopped), stopped

            # The auto re-execution daemon retries it from the failure; the queue launches the retry.
            list(consume_new_runs_for_automatic_reexecution(wpc, [instance.get_run_record_by_id(run.run_id)], LOG))
            retry_id = instance.get_run_by_id(run.run_id).tags.get(AUTO_RETRY_RUN_ID_TAG)
            assert retry_id, [e.dagster_event.message for e in instance.all_logs(run.run_id) if e.dagster_event]
            _dequeue(wpc)
            status = wait_for("the retry to finish", lambda: _status(instance, retry_id) in FINISHED
                               and _status(instance, retry_id))
            retry = instance.get_run_by_id(retry_id)
            logs = instance.all_logs(retry_id)
            engine = instance.all_logs(run.run_id, of_type=DagsterEventType.ENGINE_EVENT)  # of the run that died
            accounts = [m for m in (e.dagster_event.message or "" for e in engine) if m.startswith("Factory: ")]
            assert status == DagsterRunStatus.SUCCESS, [e.dagster_event.message for e in logs if e.dagster_event]
    assert retry.root_run_id == run.run_id and retry.tags["dagster/retry_number"] == "1"

    # The same factory run, resumed: attempt 2 from the step attempt 1 stopped at, every step once.
    with Lake.open(factory_home(home)) as lake:
        (row,) = lake.read("runs").to_pylist()
        (cut,) = lake.read("interruptions").to_pylist()
        steps = sorted(lake.read("steps").column("step").to_pylist())
    assert (row["run_id"], row["status"], row["attempts"]) == (f"killrw-{run.run_id[:8]}", "succeeded", 2)
    assert (cut["resumed_from_step"], cut["steps_lost"]) == (stopped_at, 0)
    assert steps == list(range(1, 9))
    (mat,) = [e.asset_materialization for e in logs if e.dagster_event
              and e.dagster_event.event_type == DagsterEventType.ASSET_MATERIALIZATION]
    assert mat.metadata["run_id"].value == row["run_id"] and mat.metadata["attempts"].value == 2

    # The retry's page says what happened, in words and as an observation of grpo_run.
    (obs,) = [e.asset_observation for e in logs if e.dagster_event  # others: inputs, progress
              and e.dagster_event.event_type == DagsterEventType.ASSET_OBSERVATION
              and "cause" in e.asset_observation.metadata]
    assert obs.asset_key == AssetKey("grpo_run")
    md = {k: v.value for k, v in obs.metadata.items()}
    assert (md["cause"], md["stopped_at_step"], md["resumed_from_step"], md["steps_lost"]) == (
        "supervisor_lost", stopped_at, stopped_at, 0)
    assert f"resumed from step {stopped_at}" in md["interrupted"] and "run worker" in md["interrupted"]
    # and the run that died says it too, beside Dagster's out-of-memory guess for every SIGKILL (issue 24)
    assert accounts == [f"Factory: run {row['run_id']}: {md['interrupted']}, by Dagster run {retry_id}. Dagster's "
                        "out-of-memory hint above is the one it gives every run worker killed by SIGKILL: the run "
                        "worker died; what the training run did is this."]
    warnings = [e.user_message for e in logs if e.level == logging.WARNING]
    assert any(f"resumed from step {stopped_at}" in w for w in warnings), warnings
