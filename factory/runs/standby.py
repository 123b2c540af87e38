"""The warm standby of a supervised run: one process that pays the start-up (imports of torch, transformers and the
engine; opening the lake and MLflow) once, then forks each attempt, so that every restart starts warm, however soon
after the last one the attempt died.

Both sides live here:
- `serve` is the standby (`factory attempt RUN_ID --standby`): it warms up, then reads `go ATTEMPT` lines on stdin.
  For each it forks a child that runs the attempt (returning from `serve` into the command line's normal exit, so
  the attempt ends exactly as a cold-started one would), reports `pid PID` and, once the child is gone,
  `exit PID RC` (RC as `subprocess` writes it: negative for a signal) on the report pipe named by
  `$FACTORY_STANDBY_FD`. It ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group; the attempt
  handles it, and the standby must outlive it), and exits when stdin closes. A child dies with its standby
  (PR_SET_PDEATHSIG): no attempt outlives the process that reports its exit. An attempt of a run that starts a
  rollout server (`rollout.engine: server`) forks, before anything else, a warm spare for it (infra/spare.py), so
  the server starts warm too; a server restarted later in the attempt starts cold.
- `Standby` is the supervisor's handle on that process, and `Forked` its handle on one forked attempt, with the
  part of `subprocess.Popen`'s face the supervisor uses (`pid`, `poll`, `wait`, `kill`, `send_signal`,
  `returncode`).

Forking is safe here because the standby has run no torch operation (no OpenMP pool exists to be copied) and
closes its database connections (MLflow's SQLAlchemy pools) before it forks; each attempt opens its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

from factory.cockpit.tracking import Tracker
from factory.config import parse_spec
from factory.home import FactoryPaths
from factory.infra import spare
from factory.lake.writer import Lake
from factory.runs.attempt import read_launch
from factory.runs.recovery import run_row, spec_of_run

REPORT_ENV = "FACTORY_STANDBY_FD"  # the write end of the report pipe, in the standby
_PR_SET_PDEATHSIG = 1
_STOPS = (signal.SIGINT, signal.SIGTERM)  # an attempt stops at a resume point on these; the standby ignores them


def serve(paths: FactoryPaths, run_id: str, attempt: Callable[[FactoryPaths, str], int]) -> int:
    """The standby's loop (see the module docstring). Returns in a forked child with `attempt`'s exit code, and
    in the standby itself with 0 once stdin closes."""
    report = int(os.environ.pop(REPORT_ENV))
    serves = False
    try:
        serves = _warm_up(paths, run_id)
    except Exception:  # noqa: BLE001 - e.g. the lake down: each attempt meets it, and handles it as it must
        pass
    # What each attempt gets back: the handlers this process started with, except an ignore it inherited (a parent
    # that ignored SIGTERM would leave every attempt unstoppable): then a fresh interpreter's.
    old = {s: _stoppable(s, signal.signal(s, signal.SIG_IGN)) for s in _STOPS}
    for line in sys.stdin:
        words = line.split()
        if len(words) != 2 or words[0] != "go" or not words[1].isdigit():
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        # Blocked across the fork: a SIGTERM or SIGINT sent to the child before it has its handlers back stays
        # pending (a blocked signal is never discarded as ignored) and reaches it once they are back.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
        standby = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(report)
            _become_attempt(old, words[1], standby)
            if serves:  # its rollout server starts warm too: forked now, before the attempt runs anything
                spare.install(spare.Spare.fork())
            return attempt(paths, run_id)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
        _say(report, f"pid {pid}")
        _, status = os.waitpid(pid, 0)
        _say(report, f"exit {pid} {os.waitstatus_to_exitcode(status)}")
    return 0


def _warm_up(paths: FactoryPaths, run_id: str) -> bool:
    """What every attempt pays at its start and can inherit: the lake's catalog and MLflow's store, opened once
    (their module-level caches stay warm), then every database connection closed (none may cross a fork). Returns
    whether the run's attempts start a rollout server (`rollout.engine: server`): each then gets a warm spare for it
    (infra/spare.py; the server's own modules cost about 0.1 s once torch and the engine are imported)."""
    row = None
    with contextlib.suppress(Exception):  # the lake down: each attempt meets it and waits for it (runs/degraded.py)
        with Lake.open(paths) as lake:
            row = run_row(lake, run_id)
    try:
        Tracker(paths)
    finally:
        for engine in list(getattr(SqlAlchemyStore, "_engine_map", {}).values()):  # MLflow's engine cache, per URI
            engine.dispose()
    launch = read_launch(paths.checkpoints / run_id)
    spec = spec_of_run(row) if row else parse_spec(launch["spec"], source=f"run {run_id}") if launch else None
    return spec is not None and spec.rollout.engine == "server"


def _stoppable(signum: int, handler: object) -> object:
    if handler is not signal.SIG_IGN:
        return handler
    return signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL


def _become_attempt(handlers: dict, attempt: str, standby: int) -> None:
    """In the forked child: die with the standby, stdin off the go-pipe, the signals an attempt handles back (and
    unblocked)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the supervisor still sees the standby die
    if os.getppid() != standby:
        os._exit(128 + signal.SIGKILL)  # the standby died before the death signal was armed
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ["FACTORY_ATTEMPT"] = attempt
    for s, h in handlers.items():
        signal.signal(s, h)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # what arrived since the fork is delivered now


def _say(fd: int, line: str) -> None:
    try:
        os.write(fd, f"{line}\n".encode())
    except BrokenPipeError:
        pass  # the supervisor is gone; stdin's end ends this process


class Standby:
    """The supervisor's side: the standby process of run `run_id` (started at once, warming up while the supervisor
    goes on), and the attempts it forks one at a time."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        read, write = os.pipe()
        self.proc = subprocess.Popen([*argv, "--standby"], stdin=subprocess.PIPE, text=True,
                                     env={**env, REPORT_ENV: str(write)}, pass_fds=(write,))
        os.close(write)
        self._reports = read
        self._buffer = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def go(self, attempt: int) -> Forked:
        """Fork attempt `attempt` (once the standby is warm); its handle at once."""
        try:
            self.proc.stdin.write(f"go {attempt}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died just now: the handle reads its end, an attempt killed, and the next one starts anew
        return Forked(self)

    def read(self, timeout: float) -> str | None:
        """The next report line, waiting up to `timeout` s; '' once the standby is gone and all is read."""
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._reports], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self._reports, 4096)
            if not chunk:
                return ""
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        """End the standby: it exits on stdin's end (forcibly after 30 s)."""
        if self.alive():
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        os.close(self._reports)


class Forked:
    """One attempt forked by a `Standby`: `subprocess.Popen`'s face, from the standby's reports. `pid` is None until
    the standby has forked it (it may still be warming up)."""

    def __init__(self, standby: Standby):
        self.standby = standby
        self.pid: int | None = None
        self.returncode: int | None = None
        self._pending: list[int] = []  # signals sent before the fork, delivered on it

    def poll(self) -> int | None:
        self._take(timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired("attempt", timeout)
            self._take(timeout=min(left, 1.0))
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is not None:
            return
        if self.pid is None:
            self._pending.append(signum)
            return
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        if self.pid is None and self.returncode is None:
            self.standby.proc.kill()  # stuck before the fork (e.g. warming up): the standby goes instead
        self.send_signal(signal.SIGKILL)

    def _take(self, timeout: float) -> None:
        """Read the standby's reports: the fork's pid, then the exit; a standby gone without the exit report took
        its child with it (PR_SET_PDEATHSIG): SIGKILL, once that child is gone."""
        while self.returncode is None:
            line = self.standby.read(timeout)
            if line is None:
                return
            if line == "":
                self.standby.proc.wait()
                if self.pid is not None:
                    _gone(self.pid, limit_s=30.0)
                self.returncode = -signal.SIGKILL
                return
            words = line.split()
            if words[0] == "pid":
                self.pid = int(words[1])
                for s in self._pending:
                    self.send_signal(s)
                self._pending.clear()
            elif words[0] == "exit" and int(words[1]) == self.pid:
                self.returncode = int(words[2])
            timeout = 0.0


def _gone(pid: int, limit_s: float) -> None:
    """Wait (bounded) until process `pid`, not our child, has exited."""
    deadline = time.monotonic() + limit_s
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return stat[stat.rindex(")") + 2]
