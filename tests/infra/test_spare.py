"""Warm spares (factory/infra/spare.py): a forked process that becomes a service's command, with the face of a
`subprocess.Popen` and the behaviour of a cold start (session, output, exit codes, signals), used by `ServiceProcess`
for its first start only."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from factory.infra.spare import Spare
from factory.infra.supervisor import ServiceProcess
from tests.polling import process_gone, wait_for

HERE = Path(__file__).parent
ENV = {"PYTHONPATH": str(HERE)}  # the cold restart finds the test modules as `python -m` does


def flaky(tmp_path, spare) -> ServiceProcess:
    return ServiceProcess("flaky", [sys.executable, "-m", "flaky_service", "{port}", str(tmp_path / "marker")],
                          log_path=tmp_path / "svc.log", startup_timeout=30, env=ENV, spare=spare)


def test_the_first_start_runs_in_the_spare_and_a_restart_starts_cold(tmp_path):
    spare = Spare.fork()
    with flaky(tmp_path, spare) as svc:
        assert svc.pid == spare.pid
        assert os.getpgid(svc.pid) == svc.pid  # its own session, as start_new_session gives a cold start
        assert Path(f"/proc/{svc.pid}/comm").read_text().strip() == "flaky"  # named where process tools look
        assert httpx.get(f"{svc.url}/echo?x=warm").text == "warm"
        svc.kill()
        assert svc.ensure_alive() is True
        assert svc.pid != spare.pid and svc.restarts == 1
        assert httpx.get(f"{svc.url}/echo?x=cold").text == "cold"
    assert process_gone(spare.pid)


def test_a_spare_reports_its_command_s_exit_code_and_output(tmp_path):
    with flaky(tmp_path, Spare.fork()) as svc:
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{svc.url}/crash")
        assert svc._proc.wait(timeout=30) == 3
        assert "poisoned request" in (tmp_path / "svc.log").read_text()  # its stderr went to the service's log


@pytest.mark.parametrize(("value", "code"), [("None", 0), ("7", 7), (str(10**100), 255), ("-1", 255), ("'bye'", 1)])
def test_exit_codes_are_python_s(tmp_path, value, code):
    proc = Spare.fork().run([sys.executable, "-m", "exits_with", value], log_path=tmp_path / "out.log")
    assert proc.wait(timeout=30) == code
    assert subprocess.run([sys.executable, "-m", "exits_with", value], env={**os.environ, **ENV},
                          capture_output=True).returncode == code  # what a cold start gives
    assert f"argv {[value]}" in (tmp_path / "out.log").read_text()


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, -signal.SIGINT), (signal.SIGTERM, -signal.SIGTERM)])
def test_signals_end_the_command_as_they_end_a_fresh_interpreter(tmp_path, sig, code):
    old = signal.signal(signal.SIGTERM, lambda *_: None)  # the parent's handlers are not the command's
    try:
        with flaky(tmp_path, Spare.fork()) as svc:
            svc._proc.send_signal(sig)
            assert svc._proc.wait(timeout=30) == code
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_command_the_spare_cannot_run_starts_cold_and_the_spare_ends(tmp_path):
    spare = Spare.fork()
    script = str(HERE / "flaky_service.py")  # a script path, not `-m MODULE`
    with ServiceProcess("flaky", [sys.executable, script, "{port}", str(tmp_path / "m")], startup_timeout=30,
                        spare=spare) as svc:
        assert svc.pid != spare.pid
        assert httpx.get(f"{svc.url}/echo?x=1").text == "1"
    assert process_gone(spare.pid)


def test_an_unused_spare_ends_when_its_service_stops_or_it_is_closed(tmp_path):
    spare = Spare.fork()
    flaky(tmp_path, spare).stop()
    assert process_gone(spare.pid)
    other = Spare.fork()
    other.close()
    assert process_gone(other.pid)
    with pytest.raises(ValueError, match="already"):
        other.run([sys.executable, "-m", "exits_with", "0"])


def test_a_spare_dies_with_its_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, threading
        from factory.infra.spare import Spare
        print(Spare.fork().pid, flush=True)
        threading.Event().wait()
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(HERE.parents[1])})
    pid = int(parent.stdout.readline())
    assert not process_gone(pid)
    parent.kill()
    parent.wait(timeout=30)
    wait_for(f"spare {pid} to die with its parent", lambda: process_gone(pid), 30)
