"""The warm standby (`runs/standby.py`): one process forks every attempt, reports each one's pid and exit code, outlives
a Ctrl-C aimed at its attempt, takes its attempt with it when it dies, and exits when its stdin closes. Driven through
the supervisor's handle (`Standby`, `Forked`) with a small attempt function standing in for a training attempt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from factory.runs.standby import Standby
from tests.polling import process_gone, wait_for

# The standby's command line: `serve` with an attempt that records what it sees, then behaves by attempt number.
SCRIPT = """
import json, os, sys, time
from pathlib import Path
from factory.home import FactoryPaths
from factory.infra import spare
from factory.runs.standby import serve

out = Path(sys.argv[2])

def attempt(paths, run_id):
    n = os.environ["FACTORY_ATTEMPT"]
    warm = spare.take()
    (out / f"{n}.json").write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "run_id": run_id,
                                               "stdin": os.readlink("/proc/self/fd/0"),
                                               "spare": warm and warm.pid}))
    if n == "1":
        return 3
    while True:  # waits to be signalled
        time.sleep(0.05)

sys.exit(serve(FactoryPaths(Path(sys.argv[1])), "run-x", attempt))
"""


def _standby(tmp_path: Path, ignoring: bool = False) -> Standby:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-c", SCRIPT, str(tmp_path / "home"), str(tmp_path)]
    if ignoring:  # started by a parent that ignores SIGTERM and SIGINT (an ignore survives exec)
        argv = [sys.executable, "-c", "import os, signal, sys; [signal.signal(s, signal.SIG_IGN) for s in "
                "(signal.SIGTERM, signal.SIGINT)]; os.execv(sys.executable, sys.argv[1:])", *argv]
    return Standby(argv, env)


def _seen(tmp_path: Path, attempt: int) -> dict:
    path = tmp_path / f"{attempt}.json"
    return json.loads(wait_for(f"attempt {attempt} to start", lambda: path.exists() and path.read_text(), limit_s=120.0,
                               every_s=0.02))


def test_one_standby_forks_each_attempt_and_reports_its_exit(tmp_path):
    standby = _standby(tmp_path)
    try:
        first = standby.go(1)
        assert first.wait(timeout=120) == 3
        seen = _seen(tmp_path, 1)
        assert (seen["pid"], seen["ppid"], seen["run_id"]) == (first.pid, standby.proc.pid, "run-x")
        assert seen["stdin"] == os.devnull  # the go-pipe is the standby's alone

        second = standby.go(2)  # the same warm process forks the next attempt
        seen = _seen(tmp_path, 2)
        assert second.poll() is None  # running; the poll has read the fork's report
        assert seen["ppid"] == standby.proc.pid and second.pid == seen["pid"] != first.pid
        second.kill()
        assert second.wait(timeout=60) == -signal.SIGKILL
        assert standby.alive()
    finally:
        standby.close()
    assert standby.proc.returncode == 0  # stdin's end: it exits by itself


def test_a_ctrl_c_reaches_the_attempt_not_the_standby(tmp_path):
    standby = _standby(tmp_path)
    try:
        attempt = standby.go(2)
        _seen(tmp_path, 2)
        os.kill(standby.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends the whole process group
        os.kill(standby.proc.pid, signal.SIGTERM)
        attempt.send_signal(signal.SIGTERM)  # the attempt has its default handler back
        assert attempt.wait(timeout=60) == -signal.SIGTERM
        assert standby.alive()
    finally:
        standby.close()


def test_an_attempt_dies_with_its_standby(tmp_path):
    standby = _standby(tmp_path)
    try:
        attempt = standby.go(2)
        pid = _seen(tmp_path, 2)["pid"]
        standby.proc.kill()
        assert attempt.wait(timeout=60) == -signal.SIGKILL
        assert process_gone(pid)
    finally:
        standby.close()


def test_an_attempt_is_stoppable_even_when_the_standby_inherited_an_ignored_sigterm(tmp_path):
    standby = _standby(tmp_path, ignoring=True)
    try:
        attempt = standby.go(2)
        _seen(tmp_path, 2)
        attempt.send_signal(signal.SIGTERM)
        assert attempt.wait(timeout=120) == -signal.SIGTERM  # ignored, it would run until the wait timed out
        assert standby.alive()  # the standby itself still ignores it
    finally:
        standby.close()


def test_a_signal_sent_before_the_fork_is_delivered_on_it(tmp_path):
    standby = _standby(tmp_path)
    try:
        attempt = standby.go(2)
        attempt.send_signal(signal.SIGTERM)  # its pid unread yet: the handle holds the signal until the fork
        assert attempt.wait(timeout=120) == -signal.SIGTERM
    finally:
        standby.close()


def test_the_standby_runs_a_real_attempt_command(tmp_path):
    """`factory attempt RUN --standby` is what the supervisor starts: for an unknown run the forked attempt says so
    and exits with the needs-a-fix code, as a cold attempt would."""
    from factory.runs.exit_codes import EXIT_NEEDS_FIX

    home = tmp_path / "home"
    argv = [sys.executable, "-m", "factory.cli", "--home", str(home), "attempt", "no-such-run"]
    err = tmp_path / "err"
    with open(err, "w") as f:
        env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
        proc = subprocess.run(argv, stderr=f, env=env, timeout=300)
    cold = proc.returncode
    standby = Standby(argv, env)
    try:
        assert standby.go(1).wait(timeout=300) == cold == EXIT_NEEDS_FIX
    finally:
        standby.close()
    assert "no run 'no-such-run'" in err.read_text()


def test_an_attempt_of_a_run_with_a_rollout_server_gets_a_warm_spare_for_it(tmp_path):
    """`rollout.engine: server`: each forked attempt forks a spare (its own child) for the server's first start; a
    run without a server gets none."""
    from factory.config import parse_spec
    from factory.runs.attempt import write_launch

    spec = parse_spec({"name": "x", "schedule": {"mode": "async"}, "rollout": {"engine": "server"}}, source="test")
    write_launch(tmp_path / "home" / "checkpoints" / "run-x", spec, "init")
    standby = _standby(tmp_path)
    try:
        first = standby.go(1)
        assert first.wait(timeout=300) == 3
        seen = _seen(tmp_path, 1)
        assert seen["spare"] and seen["spare"] != seen["pid"]
        wait_for("the unused spare to end with its attempt", lambda: process_gone(seen["spare"]), limit_s=60.0)
    finally:
        standby.close()
    (tmp_path / "1.json").unlink()
    write_launch(tmp_path / "home" / "checkpoints" / "run-x", parse_spec({"name": "x"}, source="test"), "init")
    standby = _standby(tmp_path)
    try:
        assert standby.go(1).wait(timeout=300) == 3
        assert _seen(tmp_path, 1)["spare"] is None
    finally:
        standby.close()
