"""An attempt's view of its supervisor (`runs/attempt.py`): `supervisor_lost` and `OrphanGuard`, which kills an
attempt that lost its supervisor and then stopped beating (the hang check the dead supervisor would have made)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from factory.runs.attempt import SUPERVISOR_ENV, AttemptLock, supervisor_lost

# A supervisor that starts one attempt-like child and waits for it; the child holds the run's lock, beats once,
# then hangs under an OrphanGuard.
CHILD = """
import sys, threading, pathlib
from factory.runs.attempt import AttemptLock, OrphanGuard, beat
run_dir = pathlib.Path(sys.argv[1])
lock = AttemptLock(run_dir)
beat(run_dir)
with OrphanGuard(run_dir, hang_timeout_s=0.5, poll_s=0.05):
    threading.Event().wait()  # a hung loop: no step, no beat
"""
SUPERVISOR = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stderr=open(sys.argv[3], "w"),
                         env={**os.environ, "FACTORY_SUPERVISOR_PID": str(os.getpid())})
print(child.pid, flush=True)
child.wait()
"""


def test_supervisor_lost_only_when_the_named_supervisor_is_neither_parent_nor_grandparent(monkeypatch):
    monkeypatch.delenv(SUPERVISOR_ENV, raising=False)
    assert not supervisor_lost()  # not supervised: nothing to lose
    monkeypatch.setenv(SUPERVISOR_ENV, str(os.getppid()))
    assert not supervisor_lost()
    grandparent = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()[1]
    monkeypatch.setenv(SUPERVISOR_ENV, grandparent)  # an attempt forked by the run's warm standby
    assert not supervisor_lost()
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    monkeypatch.setenv(SUPERVISOR_ENV, str(gone.pid))
    assert supervisor_lost()


def _until(what: str, ready, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s  # only so a broken guard cannot hang the test run
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_an_orphaned_attempt_that_stops_beating_kills_itself(tmp_path: Path):
    run_dir, err = tmp_path / "run", tmp_path / "child.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, CHILD, str(run_dir), str(err)],
                           stdout=subprocess.PIPE, text=True, env=env)
    child_pid = int(sup.stdout.readline())
    _until("the child to hold the run's lock", lambda: AttemptLock.is_held(run_dir))
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait()
    # With its supervisor gone and no beat for longer than its hang timeout, the child SIGKILLs itself (the kernel
    # then releases its lock); nobody else is left to do it.
    _until("the orphaned child to die", lambda: not AttemptLock.is_held(run_dir))
    assert "lost its supervisor" in err.read_text()
    assert not Path(f"/proc/{child_pid}/cmdline").exists() or not Path(f"/proc/{child_pid}/cmdline").read_bytes()
