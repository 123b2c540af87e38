"""A step's trainer watches its run worker (assets/_retries.py `watched_by_run_worker`): real processes, a "run worker"
whose child runs a real Dagster materialization, as the multiprocess executor runs a step. Inside the block the worker
is the attempt's supervisor (`FACTORY_SUPERVISOR_PID`), so `supervisor_lost()`, which the training loop checks at every
step (runs/rl_run.py), turns true when the worker is SIGKILLed; what ends the block then fails the step without a
retry request, naming the dead worker (the run's own retry resumes the run). Where no worker records its pid (a
materialization in the test's process), nothing is watched. The whole chain with a real run worker and training is
tests/jobs/test_run_worker_kill.py."""


import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from dagster import AssetExecutionContext, DagsterInstance, MaterializeResult, asset, materialize

from assets._retries import run_worker_parent, wait_for_previous_attempt, watched_by_run_worker
from factory.runs.attempt import SUPERVISOR_ENV
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]

# The step: records its parent as the run's worker (what the code server writes when it starts one), then trains
# until its supervisor is lost, as the loop would, and stops.
STEP = """
import json, os, sys, time
from pathlib import Path
from dagster import AssetExecutionContext, DagsterInstance, RetryPolicy, asset, materialize
from dagster._core.events import EngineEventData
from assets._retries import watched_by_run_worker
from factory.runs.attempt import supervisor_lost

out = Path(sys.argv[1])

@asset(retry_policy=RetryPolicy(max_retries=2))
def trains(context: AssetExecutionContext) -> None:
    worker = os.getppid()
    context.instance.report_engine_event(f"Started process for run (pid: {worker}).", context.run,
                                         EngineEventData.in_process(worker))
    with watched_by_run_worker(context) as pid:
        (out / "ready").write_text(json.dumps({"pid": pid, "env": os.environ.get("FACTORY_SUPERVISOR_PID"),
                                               "lost": supervisor_lost()}))
        while not supervisor_lost():  # the training loop's check at each step
            time.sleep(0.05)
        raise RuntimeError("stopped on request after step 3; resume point written")

with DagsterInstance.ephemeral() as instance:
    result = materialize([trains], instance=instance, raise_on_error=False)
data = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"][0].event_specific_data
said = data.user_failure_data.description if data.user_failure_data else data.error.to_string()
(out / "result.json").write_text(json.dumps({
    "error": said,
    "retried": len([e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]),
    "env_after": os.environ.get("FACTORY_SUPERVISOR_PID")}))
"""
WORKER = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], sys.argv[2]])"



def test_the_trainer_of_a_step_stops_when_its_run_worker_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(SUPERVISOR_ENV, None)
    # Its own process group: the step outlives the worker, and the group reaches it whatever happens here.
    worker = subprocess.Popen([sys.executable, "-c", WORKER, STEP, str(tmp_path)], cwd=ROOT, env=env,
                              start_new_session=True)
    try:
        ready = json.loads(wait_for("the step to train", lambda: (tmp_path / "ready").is_file()
                                     and (tmp_path / "ready").read_text()))
        assert ready == {"pid": worker.pid, "env": str(worker.pid), "lost": False}  # watched, its worker alive
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        # The orphaned step notices, stops and fails without asking for a retry (nothing would act on it).
        got = json.loads(wait_for("the orphaned step to stop", lambda: (tmp_path / "result.json").is_file()
                                   and (tmp_path / "result.json").read_text()))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)  # the step too, should it still be there (a failure above)
        worker.wait()
    assert f"the run worker (pid {worker.pid}) is gone" in got["error"]
    assert "stopped on request after step 3" in got["error"]
    assert got["retried"] == 0 and got["env_after"] is None


def test_a_step_without_a_run_worker_of_its_own_is_not_watched():
    seen = {}

    @asset
    def trains(context: AssetExecutionContext) -> MaterializeResult:
        seen["parent"] = run_worker_parent(context)
        with watched_by_run_worker(context) as pid:
            seen["pid"], seen["env"] = pid, os.environ.get(SUPERVISOR_ENV)
        return MaterializeResult()

    with DagsterInstance.ephemeral() as instance:
        assert materialize([trains], instance=instance).success
    assert seen == {"parent": None, "pid": None, "env": os.environ.get(SUPERVISOR_ENV)}


# An earlier attempt that holds the run's lock until told to let go (its `go` file), as an orphaned trainer does until
# its next step.
HOLDER = """
import sys, time
from pathlib import Path
from factory.runs.attempt import AttemptLock
run_dir, held, go = (Path(a) for a in sys.argv[1:])
with AttemptLock(run_dir):
    held.touch()
    while not go.exists():
        time.sleep(0.01)
"""


def test_a_retry_waits_for_the_earlier_attempt_to_let_go_of_the_run(tmp_path):
    run_dir, held, go = tmp_path / "run", tmp_path / "held", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(held), str(go)], env=env)
    try:
        wait_for("the earlier attempt to hold the lock", held.exists)
        said: list[str] = []

        def log(line: str) -> None:  # the retry says it waits, then the earlier attempt lets go
            said.append(line)
            go.touch()

        assert wait_for_previous_attempt(run_dir, timeout_s=300.0, log=log, poll_s=0.01)
        assert holder.wait() == 0 and len(said) == 1 and "still holds" in said[0]
        assert wait_for_previous_attempt(run_dir, timeout_s=300.0, log=said.append) and len(said) == 1  # free: no wait
    finally:
        go.touch()
        holder.wait()


def test_a_retry_stops_waiting_for_an_attempt_that_never_lets_go(tmp_path):
    run_dir, held, go = tmp_path / "run", tmp_path / "held", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(held), str(go)], env=env)
    try:
        wait_for("the earlier attempt to hold the lock", held.exists)
        assert not wait_for_previous_attempt(run_dir, timeout_s=0.2, log=lambda line: None, poll_s=0.01)
        assert holder.poll() is None  # still holding: the run's own refusal names the lock
    finally:
        go.touch()
        holder.wait()
