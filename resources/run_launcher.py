"""Dagster's default run launcher, with a health check of its run workers, so that run monitoring notices a run
worker that died (kill -9, the OOM killer) and run retries re-execute its run.

Dagster's `DefaultRunLauncher` starts each run worker as a child process of the code location server and cannot
say whether it is still alive (`supports_check_run_worker_health` is False): a killed worker leaves its run
STARTED for good, and nothing retries it. `WatchedRunLauncher` reads the worker's pid from the run's own
"Started process for run (pid: N)" engine event and asks the OS: the worker is RUNNING while a process with that
pid exists and started no later than that event (a later process reusing the pid is not the worker), FAILED
otherwise. With run monitoring enabled, the daemon then marks the run failed; with run retries enabled (and the
training jobs' `dagster/max_retries` tag, assets/_retries.py) the auto re-execution daemon launches a retry from
the failed step, which keeps the root run id, so `grpo_run` resumes the same factory run.

The pid is only meaningful on the machine that runs the worker: use this launcher where the daemon and the code
location server share one machine (`dagster dev`, one VM); the cluster uses the K8sRunLauncher, which checks its
Jobs itself. Instance settings: deploy/dagster.yaml.
"""

from __future__ import annotations

import os
from pathlib import Path

from dagster import DagsterEventType, DagsterInstance, DagsterRun
from dagster._core.launcher import CheckRunHealthResult, DefaultRunLauncher, WorkerStatus
from dagster._serdes import ConfigurableClassData

START_MESSAGE = "Started process for run (pid: "
_CLOCK_SLACK_S = 1.0  # process start times are read in clock ticks; event timestamps in floats


class WatchedRunLauncher(DefaultRunLauncher):
    """`DefaultRunLauncher` whose run workers run monitoring can check (see the module docstring)."""

    def __init__(self, inst_data: ConfigurableClassData | None = None):
        super().__init__(inst_data=inst_data)

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: dict) -> WatchedRunLauncher:
        return cls(inst_data=inst_data)

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        found = worker_pid(self._instance, run.run_id)
        if found is None:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "no run worker pid recorded for this run yet")
        pid, started_at = found
        return pid_health(pid, started_at)


def worker_pid(instance: DagsterInstance, run_id: str) -> tuple[int, float] | None:
    """The newest run worker pid the run's engine events recorded, with when it was recorded; None if none."""
    for entry in reversed(instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT)):
        event = entry.dagster_event
        if event is None or not (event.message or "").startswith(START_MESSAGE):
            continue
        pid = event.engine_event_data.metadata.get("pid")
        if pid is not None and str(pid.value).isdigit():
            return int(pid.value), entry.timestamp
    return None


def pid_health(pid: int, recorded_at: float) -> CheckRunHealthResult:
    """RUNNING if `pid` is a live process that existed when its start was recorded, else FAILED."""
    started = _process_start(pid)
    if started is not None and started <= recorded_at + _CLOCK_SLACK_S:
        return CheckRunHealthResult(WorkerStatus.RUNNING, run_worker_id=str(pid))
    return CheckRunHealthResult(WorkerStatus.FAILED, f"run worker process {pid} is gone (killed or crashed)",
                                run_worker_id=str(pid))


def _process_start(pid: int) -> float | None:
    """When process `pid` started (epoch seconds, from /proc), or None if there is no such live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    if fields[0] in ("Z", "X"):  # a zombie or dead: exited, not yet reaped
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
