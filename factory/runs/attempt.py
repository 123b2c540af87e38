"""One attempt of a training run: its lock, its signs of life, and what its run directory holds.

A run directory (`checkpoints/<run_id>/`) holds, besides checkpoints:
- `attempt.lock`: held (flock) by the live attempt for its whole life. The kernel releases it when the
  process dies however it dies (kill -9 included), so any reader on the host can tell a live run from a
  dead one that still says `running` in the lake, without trusting pids (which get reused).
- `heartbeat`: touched by the trainer's own loop at every step and sub-step. A supervisor reads its age
  to tell a hung attempt from a slow one (a thread beating on its own would hide a hung loop).
- `resume/`: the resume points (`core/resume.py`), taken when `runs/resume_points.py` says.
- `launch.json`: what the first attempt of a supervised run needs before the run has a `runs` row.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from factory.config import ExperimentSpec


LOCK = "attempt.lock"
HEARTBEAT = "heartbeat"
LAUNCH = "launch.json"


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
