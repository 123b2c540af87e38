"""Automatic restarts of a training run: each attempt runs in a child process (`factory attempt RUN_ID`), and
this parent starts the next one when an attempt dies, hangs or crashes, up to `ops.max_restarts` times.

Like torchrun's elastic agent, but for one run and with exact resume: the parent holds no training state.
It watches two things: the child's exit, and the age of the run's heartbeat (`runs/attempt.py`), which the
training loop itself touches. An attempt silent for longer than `ops.hang_timeout_s` is killed (SIGKILL)
and recorded as a hang, after it printed every thread's stack into the run's log (`STACKS_SIGNAL`: where it
hung); PyTorch's own watchdog would wait 10 minutes. How an attempt ended decides what
follows:
- exit 0: the run succeeded;
- `EXIT_STOPPED`: it stopped on request (SIGTERM/SIGINT, forwarded by this parent too): no restart;
- `EXIT_NEEDS_FIX`: it stopped for good until something is fixed (non-finite losses, a circuit breaker
  that tripped on a crash-looping service): no restart; `factory resume RUN_ID` once fixed;
- `EXIT_LOGPROB_GAP`: the rollout engine's log-probs and the trainer's disagree past `ops.max_logprob_gap` (at
  step 0, or for `ops.max_gap_steps` steps; `core/gate.py`): no restart, and that exit code is returned;
- `EXIT_BAD_INPUT`: a data source's row it cannot read (the attempt named the source, file and line): no restart,
  and that exit code is returned;
- `EXIT_DEPENDENCY_DOWN`, `EXIT_DISK_FULL`: the lake stayed down past `ops.lake_outage_s`, or a disk is full: the
  attempt stopped at a resume point and said why; restarting would meet the same wall, so no restart is spent and
  that exit code is returned; `factory resume RUN_ID` once the lake is back or space is freed;
- anything else (killed, crashed, hung): the dead attempt is recorded (`runs/recovery.py`) and the next
  attempt resumes from the newest resume point.

A warm standby makes that fast (`runs/standby.py`): one process per run, started with the first attempt, imports
torch and the engine and opens the lake and MLflow once, then forks every attempt. A restart is a fork of an
already-warm process, whenever the last attempt died, instead of a cold process paying several seconds of imports
(measured in benchmarks/chaos.py). If the standby itself dies, the next attempt starts a new one.

Each attempt is told this supervisor's pid (`FACTORY_SUPERVISOR_PID`): if the supervisor is killed, the attempt
stops at its next resume point by itself (`runs/attempt.py`), so no attempt trains on unwatched. An attempt that
announced it finished (`announce_finished`: its result is recorded, only its exit is left) is not killed as hung;
and one that dies after that announcement, with its run recorded as succeeded, counts as a success.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from factory.config import ExperimentSpec
from factory.home import FactoryPaths
from factory.infra.disk import is_disk_full
from factory.lake.spool import is_outage
from factory.lake.writer import Lake
from factory.runs import recovery
from factory.runs.attempt import STACKS_SIGNAL, SUPERVISOR_ENV, clear_finished, finished, last_beat
from factory.runs.exit_codes import (
    EXIT_BAD_INPUT,
    EXIT_DEPENDENCY_DOWN,
    EXIT_DISK_FULL,
    EXIT_FAILED,
    EXIT_LOGPROB_GAP,
    EXIT_NEEDS_FIX,
    EXIT_OK,
    EXIT_STOPPED,
)
from factory.runs.rank_group import GROUP_EXIT, attempt_command, group_code, is_group
from factory.runs.standby import Forked, Standby

POLL_S = 0.2
STARTUP_GRACE_S = 120.0  # an attempt's start (imports, loading the model and lake) before it first beats
STACKS_WAIT_S = 2.0  # how long a hung attempt gets to print its stacks before the kill


class _Attempts:
    """Processes for attempts: forked by the run's warm standby, or cold (`warm=False`). A data-parallel run's
    attempt is a torchrun group of ranks (`runs/rank_group.py`) in its own process session, killed as a whole."""

    def __init__(self, paths: FactoryPaths, run_id: str, spec: ExperimentSpec | None = None):
        self.argv = [sys.executable, "-m", "factory.cli", "--home", str(paths.root), "attempt", run_id]
        self.group = spec is not None and is_group(spec)
        self.run_dir = paths.checkpoints / run_id
        if self.group:
            self.argv = attempt_command(paths, run_id, spec)
        self.env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}  # an attempt stops if this process dies
        self.standby: Standby | None = None  # forks the attempts of a single-process run

    def start(self, attempt: int, warm: bool) -> subprocess.Popen | Forked:
        """Attempt `attempt`: forked by the warm standby (started now if there is none alive), or, with `warm`
        False, a cold process of its own."""
        if self.group:  # no warm standby for a group: torchrun starts its ranks cold
            (self.run_dir / GROUP_EXIT).unlink(missing_ok=True)  # an earlier `factory run`/`resume`'s attempt's
            return subprocess.Popen(self.argv, env={**os.environ, "FACTORY_ATTEMPT": str(attempt),
                                                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                                    start_new_session=True)
        if not warm:
            return subprocess.Popen(self.argv, env={**self.env, "FACTORY_ATTEMPT": str(attempt)})
        if self.standby is None or not self.standby.alive():
            if self.standby is not None:
                self.standby.close()
            self.standby = Standby(self.argv, self.env)
        return self.standby.go(attempt)

    def show_stacks(self, child: subprocess.Popen | Forked) -> None:
        """Ask a single-process attempt about to be killed as hung to print its threads' stacks (its stderr is the
        run's), and give it STACKS_WAIT_S to do it; a group's ranks are not asked."""
        if self.group or child.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(STACKS_SIGNAL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=STACKS_WAIT_S)  # faulthandler writes from the signal handler: no exit to wait for

    def kill(self, child: subprocess.Popen | Forked) -> None:
        """Kill an attempt: a group's whole process session (torchrun and every rank), or the one process."""
        if self.group:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            child.kill()
        child.wait()

    def exit_code(self, child: subprocess.Popen | Forked, run_dir, attempt: int) -> int:
        """What the attempt's exit stands for (a group's: `rank_group.group_code`)."""
        if self.group:
            return group_code(run_dir, attempt, child.returncode)
        return child.returncode

    def close(self) -> None:
        if self.standby is not None:
            self.standby.close()


def supervise(paths: FactoryPaths, run_id: str, spec: ExperimentSpec, log=print, warm_standby: bool = True) -> int:
    """Run attempts of `run_id` in child processes until it succeeds, stops on request, needs a fix, or
    has used `spec.ops.max_restarts` restarts. Returns the exit code for the command line."""
    run_dir = paths.checkpoints / run_id
    ops = spec.ops
    stop: list[int] = []
    children = _Attempts(paths, run_id, spec)
    child: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        stop.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    restarts = 0
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            started = time.time()
            clear_finished(run_dir)
            child = children.start(restarts + 1, warm=warm_standby)
            hung = None
            while child.poll() is None:
                time.sleep(POLL_S)
                if child.pid is not None and finished(run_dir, child.pid):
                    continue  # its result is recorded: only its exit is left, which beats no heartbeat
                beat = last_beat(run_dir) or 0.0
                # Until this attempt's first sign of life it is starting (imports, loading): a longer grace.
                limit = ops.hang_timeout_s if beat > started else max(ops.hang_timeout_s, STARTUP_GRACE_S)
                age = time.time() - max(beat, started)
                if age > limit and not stop:
                    hung = age
                    children.show_stacks(child)
                    children.kill(child)
            rc = children.exit_code(child, run_dir, restarts + 1)
            if rc == EXIT_OK or _finished_anyway(paths, run_id, run_dir, child.pid, rc, log):
                return EXIT_OK
            if stop or rc == EXIT_STOPPED:
                log(f"run {run_id}: stopped on request; resume it with: factory resume {run_id}")
                return EXIT_STOPPED
            if rc == EXIT_NEEDS_FIX:
                return EXIT_FAILED
            if rc == EXIT_LOGPROB_GAP:  # the engine and the trainer disagree (its lines said why): a setup to fix
                log(f"run {run_id}: stopped because the rollout engine's log-probs and the trainer's disagree (see "
                    f"the lines above); no restart spent; once fixed: factory resume {run_id}")
                return EXIT_LOGPROB_GAP
            if rc == EXIT_BAD_INPUT:  # a data file gone bad (its line said on stderr): the same input fails again
                log(f"run {run_id}: stopped on bad input (see the line above); no restart spent; once fixed: "
                    f"factory resume {run_id}")
                return EXIT_BAD_INPUT
            if rc in (EXIT_DEPENDENCY_DOWN, EXIT_DISK_FULL):
                what = "the lake stayed unavailable" if rc == EXIT_DEPENDENCY_DOWN else "a disk is full"
                log(f"run {run_id}: stopped at a resume point because {what} (see the line above); no restart "
                    f"spent; once fixed: factory resume {run_id}")
                return rc
            try:
                if _record_dead(paths, run_id, run_dir, ops, rc, hung, restarts, log):
                    return EXIT_FAILED
            except Exception as e:
                # The supervisor outlives a lake outage (or a full disk): the next attempt finds the run still
                # marked live with its lock free, and records the dead attempt itself (rl_run.run_rl).
                if not (is_outage(e) or is_disk_full(e)):
                    raise
                log(f"run {run_id}: could not record the dead attempt in the lake ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); the next attempt records it")
                if restarts >= ops.max_restarts:
                    log(f"run {run_id}: ops.max_restarts = {ops.max_restarts} restarts are used up; resume it by "
                        f"hand with: factory resume {run_id}")
                    return EXIT_FAILED
            restarts += 1
            log(f"run {run_id}: attempt died ({_describe(rc)}"
                + (f", hung for {hung:.0f} s" if hung is not None else "") + f"); restart {restarts} of "
                f"{ops.max_restarts}, resuming from its newest resume point")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        children.close()


def _record_dead(paths: FactoryPaths, run_id: str, run_dir, ops, rc: int, hung: float | None, restarts: int,
                 log) -> bool:
    """Record an attempt that died without a word; True when that used up the run's restarts (marked failed)."""
    with Lake.open(paths) as lake:
        row = recovery.run_row(lake, run_id)
        if row is not None and row["status"] in recovery.LIVE:  # it died without a word
            cause = "hang" if hung is not None else "killed"
            detail = (f"no sign of life for {hung:.0f} s (ops.hang_timeout_s = {ops.hang_timeout_s:g}); "
                      "killed" if hung is not None else f"attempt exited with {_describe(rc)}")
            recovery.mark_dead(lake, row, run_dir, cause=cause, detail=detail)
        if restarts >= ops.max_restarts:
            log(f"run {run_id}: attempt died ({_describe(rc)}) and ops.max_restarts = {ops.max_restarts} "
                f"restarts are used up; resume it by hand with: factory resume {run_id}")
            if row is not None:
                latest = recovery.run_row(lake, run_id)
                lake.upsert("runs", [dict(latest, status="failed")])
            return True
    return False


def _finished_anyway(paths: FactoryPaths, run_id: str, run_dir: Path, pid: int, rc: int,
                     log: Callable[[str], object]) -> bool:
    """An attempt that died after announcing it finished, with its run recorded as succeeded: a success (its
    result is whole; restarting it would only find the run done)."""
    if not finished(run_dir, pid):
        return False
    with Lake.open(paths) as lake:
        row = recovery.run_row(lake, run_id)
    if row is None or row["status"] != "succeeded":
        return False
    log(f"run {run_id}: the attempt ended with {_describe(rc)} after recording its result; the run succeeded")
    return True


def _describe(rc: int) -> str:
    if rc < 0:
        return f"signal {signal.Signals(-rc).name}"
    return f"exit code {rc}"
