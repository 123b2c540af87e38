"""One attempt of a training run: its lock, its signs of life, and what its run directory holds.

A run directory (`checkpoints/<run_id>/`) holds, besides checkpoints:
- `attempt.lock`: held (flock) by the live attempt for its whole life. The kernel releases it when the
  process dies however it dies (kill -9 included), so any reader on the host can tell a live run from a
  dead one that still says `running` in the lake, without trusting pids (which get reused).
- `heartbeat`: touched by the trainer's own loop at every step, and from inside the work of every long phase
  (a decode step, a verified eval answer, a file written: `infra/liveness.py`). A supervisor reads its age to
  tell a hung attempt from a slow one (a thread beating on its own would hide a hung loop).
- `resume/`: the resume points (`core/resume.py`), taken when `runs/resume_points.py` says.
- `launch.json`: what the first attempt of a supervised run needs before the run has a `runs` row.
- `finished`: the pid of an attempt that recorded its result and has only its exit left; the supervisor's hang
  watchdog stands down for it (closing the lake, MLflow and the interpreter beats no heartbeat).
- `work.json`: which attempt last started training, and when (what its interruption's `redo_s` counts from).

A supervised attempt knows its supervisor (`FACTORY_SUPERVISOR_PID`). If that process dies (kill -9 of
`factory run`), nothing would watch the attempt for hangs or crashes any more, so the attempt stops itself: it
polls its parent at every step, and when the parent is gone it saves a resume point after that step and exits
with `EXIT_SUPERVISOR_LOST` (the run is `interrupted`, cause `supervisor_lost`; `factory resume` continues it).
Until then `OrphanGuard` kills it if it also stops beating for `ops.hang_timeout_s` (the watchdog it lost).
"""

from __future__ import annotations

import faulthandler
import fcntl
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from factory.config import ExperimentSpec


LOCK = "attempt.lock"
HEARTBEAT = "heartbeat"
LAUNCH = "launch.json"
FINISHED = "finished"
WORK = "work.json"
SUPERVISOR_ENV = "FACTORY_SUPERVISOR_PID"  # set by the supervisor (`runs/restarts.py`) for its attempts
STACKS_SIGNAL = signal.SIGUSR1  # an attempt prints its threads' stacks on stderr (asked before a hang kill)


def print_stacks_on_signal() -> None:
    """From now on `STACKS_SIGNAL` makes this process print every thread's Python stack on stderr and go on: a
    supervisor about to kill it as hung says where it was (faulthandler, which needs no working interpreter)."""
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


class StopRequest:
    """Why this attempt was asked to stop after its current step, or None while nobody asked: what the training loop's
    `Checkpoints.stopping()` answers (`runs/resume_points.py`) and what the loop hands back in its `LoopEnd`. The
    causes are the interruption causes the run records: `SIGNAL`, `SUPERVISOR_LOST`, `PRUNED`, `LAKE_DOWN`."""

    SIGNAL, SUPERVISOR_LOST, PRUNED, LAKE_DOWN = "signal", "supervisor_lost", "pruned", "lake_down"

    def __init__(self) -> None:
        self._cause: str | None = None
        self._lock = threading.Lock()

    def ask(self, cause: str) -> None:
        """Stop after the current step because of `cause` (a later ask replaces the cause: a signal says last)."""
        with self._lock:
            self._cause = cause

    @property
    def cause(self) -> str | None:
        return self._cause

    def __bool__(self) -> bool:
        return self._cause is not None


def resume_dir(run_dir: Path) -> Path:
    return run_dir / "resume"


def write_launch(run_dir: Path, spec: ExperimentSpec, init_checkpoint: str | Path, sweep_id: str | None = None,
                 mlflow_experiment: str | None = None, mlflow_parent_run_id: str | None = None) -> None:
    """What the first attempt needs before the run has a `runs` row (later ones read the row)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{LAUNCH}.tmp"
    tmp.write_text(json.dumps({"spec": json.loads(spec.to_json()), "init_checkpoint": str(init_checkpoint),
                               "sweep_id": sweep_id, "mlflow_experiment": mlflow_experiment,
                               "mlflow_parent_run_id": mlflow_parent_run_id}))
    os.replace(tmp, run_dir / LAUNCH)


def read_launch(run_dir: Path) -> dict:
    """What `write_launch` wrote, or {} when it wrote nothing."""
    path = run_dir / LAUNCH
    return json.loads(path.read_text()) if path.is_file() else {}


class AttemptLock:
    """Held for an attempt's life; `is_held(run_dir)` asks whether some live process holds it."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK
        self._f = self.path.open("a")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise RuntimeError(f"another attempt of this run is alive (it holds {self.path}); "
                               "stop it first, or wait for it to end") from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(f"{os.getpid()}\n")
        self._f.flush()

    def release(self) -> None:
        if not self._f.closed:
            fcntl.flock(self._f, fcntl.LOCK_UN)
            self._f.close()

    def __enter__(self) -> AttemptLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def is_held(run_dir: Path) -> bool:
        path = run_dir / LOCK
        if not path.exists():
            return False
        with path.open("a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False


def beat(run_dir: Path, step: int | None = None) -> None:
    """A sign of life from the training loop (mtime of `heartbeat`), with the last step it finished."""
    path = run_dir / HEARTBEAT
    if step is None:
        path.touch()
    else:
        path.write_text(str(step))


def beat_step(run_dir: Path) -> int | None:
    """The last step finished according to the heartbeat (trained, maybe not yet in the lake)."""
    try:
        text = (run_dir / HEARTBEAT).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def last_beat(run_dir: Path) -> float | None:
    """Wall-clock time of the last sign of life, or None if there was none."""
    try:
        return (run_dir / HEARTBEAT).stat().st_mtime
    except FileNotFoundError:
        return None


def supervisor_lost() -> bool:
    """Whether this process was started by a supervisor (`FACTORY_SUPERVISOR_PID`) that is no longer its parent, nor
    the parent of its parent (the run's warm standby, `runs/standby.py`, which forks attempts): killed, so the kernel
    gave this process (or its standby) to another parent. False for an unsupervised process."""
    pid = os.environ.get(SUPERVISOR_ENV, "")
    if not pid.isdigit():
        return False
    parent = os.getppid()
    return int(pid) not in (parent, _parent_of(parent))


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])


class OrphanGuard:
    """A daemon thread, in a supervised attempt: once its supervisor is gone it does the supervisor's hang check
    itself, killing this process (SIGKILL, as the supervisor would) when the heartbeat is older than
    `hang_timeout_s`. A live loop stops at its next step on its own (see `supervisor_lost`); this catches one that
    never reaches that step."""

    def __init__(self, run_dir: Path, hang_timeout_s: float, poll_s: float = 1.0):
        self.run_dir, self.hang_timeout_s, self.poll_s = run_dir, hang_timeout_s, poll_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="orphan-guard", daemon=True)

    def __enter__(self) -> OrphanGuard:
        if os.environ.get(SUPERVISOR_ENV):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()

    def _watch(self) -> None:
        lost_at: float | None = None
        while not self._done.wait(self.poll_s):
            if lost_at is None:
                if not supervisor_lost():
                    continue
                lost_at = time.time()
            # Silence counts from the later of the last beat and the loss: the supervisor's clock died with it.
            silent = time.time() - max(last_beat(self.run_dir) or 0.0, lost_at)
            if silent > self.hang_timeout_s and not self._done.is_set():
                print(f"factory: attempt (pid {os.getpid()}) lost its supervisor and has not beaten for {silent:.0f} s "
                      f"(ops.hang_timeout_s = {self.hang_timeout_s:g}): killing itself as hung", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def announce_finished(run_dir: Path) -> None:
    """This attempt recorded its result; what is left (closing things, exiting) needs no hang watchdog."""
    (run_dir / FINISHED).write_text(str(os.getpid()))


def finished(run_dir: Path, pid: int) -> bool:
    """Whether the attempt with process id `pid` announced that it finished (`announce_finished`)."""
    try:
        return (run_dir / FINISHED).read_text().strip() == str(pid)
    except FileNotFoundError:
        return False


def clear_finished(run_dir: Path) -> None:
    (run_dir / FINISHED).unlink(missing_ok=True)


def record_work_start(run_dir: Path, attempt: int, at: float) -> None:
    """Attempt `attempt` started training at `at` (time.time()): its interruption's redo runs from then at most."""
    tmp = run_dir / f".{WORK}.tmp"
    tmp.write_text(json.dumps({"attempt": attempt, "started": at}))
    os.replace(tmp, run_dir / WORK)


def work_start(run_dir: Path) -> tuple[int, float] | None:
    """(attempt, when it started training) of the last attempt that did, or None when not recorded here."""
    try:
        got = json.loads((run_dir / WORK).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return int(got["attempt"]), float(got["started"])
