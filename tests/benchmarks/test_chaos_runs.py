"""`benchmarks/chaos_runs.py`, the one kind of supervised run that `benchmarks/chaos.py` and
`benchmarks/chaos_faults.py` both strike: what a run reads from its run directory (heartbeat, attempt lock, fault
markers) and /proc (its attempt's live children, a zombie not counted), on real files and real processes. Starting
a real `factory run` takes minutes: that is the benchmark."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

cr = importlib.import_module("benchmarks.chaos_runs")

WAIT = "import sys; sys.stdin.read()"  # a process that lives until its stdin is closed


@pytest.fixture
def waiting() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", WAIT], stdin=subprocess.PIPE)
    yield proc
    if not proc.stdin.closed:
        proc.stdin.close()
    proc.wait()


def _end(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait()


def test_chaos_and_its_fault_runs_strike_the_same_run_class():
    chaos = importlib.import_module("benchmarks.chaos")
    faults = importlib.import_module("benchmarks.chaos_faults")
    assert chaos.Run is faults.Run is cr.Run
    assert chaos.wait_for is faults.wait_for is cr.wait_for
    assert not hasattr(faults, "FaultRun")


def test_a_run_reads_its_step_and_live_attempt_from_its_run_directory(tmp_path: Path, waiting):
    run = cr.Run(tmp_path, "sync", waiting)
    assert (run.home, run.log_path) == (tmp_path / "sync", tmp_path / "sync.log")
    assert (run.run_dir(), run.step(), run.beat_at(), run.attempt_pid()) == (None, 0, 0.0, None)
    other = tmp_path / "sync" / "checkpoints" / "sync2-ffff"  # another run's directory is not this run's
    other.mkdir(parents=True)
    assert run.run_dir() is None
    d = tmp_path / "sync" / "checkpoints" / "sync-0a1b"
    d.mkdir()
    (d / "heartbeat").write_text("7\n")
    (d / "attempt.lock").write_text(f"{waiting.pid}\n")
    assert run.run_dir() == d and run.step() == 7 and run.beat_at() == (d / "heartbeat").stat().st_mtime
    assert run.attempt_pid() == waiting.pid
    assert run.reached(7) and not run.reached(8)  # the run is still going
    (d / "heartbeat").write_text("half-writ")
    assert run.step() == 0
    _end(waiting)
    assert run.attempt_pid() is None  # the pid in the lock is dead
    assert run.reached(8)  # the run ended: the caller checks which


def _async_run(tmp_path: Path, attempt: subprocess.Popen) -> cr.Run:
    """A `Run` named async whose live attempt (its run directory's lock) is `attempt`."""
    d = tmp_path / "async" / "checkpoints" / "async-1"
    d.mkdir(parents=True)
    (d / "attempt.lock").write_text(str(attempt.pid))
    return cr.Run(tmp_path, "async", attempt)


def test_a_run_finds_its_attempts_services_among_live_children(tmp_path: Path):
    code = ("import subprocess, sys; w = subprocess.Popen([sys.executable, '-c', sys.argv[1], 'env-serve'], "
            "stdin=subprocess.PIPE); print(w.pid, flush=True); sys.stdin.read(); w.stdin.close(); w.wait()")
    attempt = subprocess.Popen([sys.executable, "-c", code, WAIT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        worker = int(attempt.stdout.readline())
        run = _async_run(tmp_path, attempt)
        (child, cmd), = cr.children(attempt.pid)
        assert child == worker and " env-serve " in cmd
        assert run.service("env-worker") == worker and run.service("rollout-server") is None
        assert cr.descendants(os.getpid()) >= {attempt.pid, worker} and cr.descendants(attempt.pid) == {worker}
    finally:
        attempt.stdin.close()
        attempt.wait()


def test_at_point_sees_the_marker_and_gives_up_when_the_run_ends(tmp_path: Path, waiting):
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / "resume_write.42").touch()
    run = cr.Run(tmp_path, "sync", waiting, faults)
    assert run.at_point("resume_write", 42)
    _end(waiting)
    assert not run.at_point("publish", 42)
    with pytest.raises(ValueError, match="faults=FACTORY_FAULT_DIR"):
        cr.Run(tmp_path, "sync", waiting).at_point("publish", 42)


def test_a_dead_unreaped_child_is_not_alive_and_a_live_one_is(waiting):
    assert cr.alive(waiting.pid)
    waiting.stdin.close()  # EOF: it exits
    os.waitid(os.P_PID, waiting.pid, os.WEXITED | os.WNOWAIT)  # exited, left a zombie (not reaped)
    assert not cr.alive(waiting.pid)
    assert waiting.pid not in cr.proc_table()
    waiting.wait()
    assert not cr.alive(waiting.pid)


def test_step_faults_counts_duplicated_and_missing_steps():
    assert cr.step_faults([1, 2, 2, 4, 4, 4], 5) == (3, 2)
    assert cr.step_faults([3, 1, 2], 3) == (0, 0)


def test_a_service_started_in_a_warm_spare_is_found_by_its_name(tmp_path: Path):
    """A rollout server started in a spare keeps the attempt's command line; the harness finds it by its comm."""
    code = ("import sys; from factory.infra.spare import Spare; s = Spare.fork(); "
            "p = s.run([sys.executable, '-m', 'http.server', '0', '--bind', '127.0.0.1'], title='rollout-server'); "
            "print(p.pid, flush=True); "
            "sys.stdin.read()")
    attempt = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server = int(attempt.stdout.readline())
        run = _async_run(tmp_path, attempt)
        assert cr.wait_for(lambda: run.service("rollout-server"), 60, every=0.01)
        assert run.service("rollout-server") == server and run.service("env-worker") is None
    finally:
        attempt.stdin.close()
        attempt.wait()
