"""Supervised services: health-gated start, restart after a kill, retry of an interrupted call, and the circuit
breaker that stops a crash loop; `retry`, the one retry loop."""

import socket
import sys
import threading
from pathlib import Path

import httpx
import pytest
import tenacity

from factory.infra.supervisor import CONNECTION_ERRORS, CircuitOpen, ServiceProcess, ServiceUnavailable, retry

SCRIPT = str(Path(__file__).with_name("flaky_service.py"))


def service(tmp_path, **kw) -> ServiceProcess:
    return ServiceProcess("flaky", [sys.executable, SCRIPT, "{port}", str(tmp_path / "marker")],
                          log_path=tmp_path / "svc.log", startup_timeout=30, **kw)


def test_start_kill_restart_same_port(tmp_path):
    with service(tmp_path) as svc:
        assert httpx.get(f"{svc.url}/echo?x=hi").text == "hi"
        first_pid, port = svc.pid, svc.port
        assert svc.ensure_alive() is False
        svc.kill()
        assert not svc.alive()
        assert svc.ensure_alive() is True
        assert (svc.restarts, svc.port) == (1, port) and svc.pid != first_pid
        assert httpx.get(f"{svc.url}/echo?x=back").text == "back"
    assert not svc.alive()


def test_starting_a_started_service_keeps_its_one_process(tmp_path):
    import os

    svc = service(tmp_path).start()
    first_pid = svc.pid
    with svc:
        svc.start()  # as SGLangServers' `with` did: before, a second process replaced the first, left unowned
        assert svc.pid == first_pid and svc.restarts == 0
    assert not svc.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)


def test_call_interrupted_by_a_crash_is_retried_once_on_the_restarted_service(tmp_path):
    marker = tmp_path / "marker"
    with service(tmp_path) as svc:
        calls = []

        def call() -> str:
            calls.append(1)
            return httpx.get(f"{svc.url}/hang", timeout=30).text

        def killer():
            # Bounded wait for the request to be in flight, then crash the server under it.
            for _ in range(3000):
                if marker.exists():
                    break
                threading.Event().wait(0.01)
            svc.kill()

        t = threading.Thread(target=killer)
        t.start()
        assert retry(call, attempts=3, on=CONNECTION_ERRORS, between=lambda n, e: svc.recover()) == "answered"
        t.join(timeout=30)
        assert len(calls) == 2 and svc.restarts == 1


def test_a_service_that_cannot_start_fails_loudly(tmp_path):
    bad = ServiceProcess("broken", [sys.executable, "-c", "raise SystemExit(3)"], startup_timeout=10)
    with pytest.raises(ServiceUnavailable, match="broken: process exited with code 3"):
        bad.start()
    assert bad.restarts == 0  # its own failure: not started again


# Killed by SIGKILL on its first start (before it answers), healthy on the second.
KILLED_ONCE = """
import os, pathlib, signal, sys
marker = pathlib.Path(sys.argv[2])
if not marker.exists():
    marker.write_text("killed")
    os.kill(os.getpid(), signal.SIGKILL)
os.execv(sys.executable, [sys.executable, sys.argv[3], sys.argv[1], sys.argv[4]])
"""


def test_a_service_killed_before_it_was_healthy_is_started_again(tmp_path):
    svc = ServiceProcess("killed-once", [sys.executable, "-c", KILLED_ONCE, "{port}", str(tmp_path / "once"), SCRIPT,
                                         str(tmp_path / "marker")], startup_timeout=30)
    with svc.start():
        assert httpx.get(f"{svc.url}/echo?x=up").text == "up"
        assert svc.restarts == 1 and [r.exit_code for r in svc.restart_history] == [-9]


def test_a_service_killed_at_every_start_trips_the_breaker(tmp_path):
    svc = ServiceProcess("always-killed", [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"],
                         startup_timeout=30, breaker_restarts=2)
    with pytest.raises(CircuitOpen, match="always-killed: circuit open"):
        svc.start()
    assert svc.restarts == 2


def test_restart_budget_is_enforced(tmp_path):
    with service(tmp_path, max_restarts=1) as svc:
        svc.kill()
        svc.ensure_alive()
        svc.kill()
        with pytest.raises(ServiceUnavailable, match="already restarted 1 times"):
            svc.ensure_alive()


def crash(svc: ServiceProcess) -> None:
    """A poisoned request: the service writes a traceback to stderr and dies under it."""
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{svc.url}/crash", timeout=30)


@pytest.mark.slow
def test_a_crash_looping_service_trips_the_breaker_with_its_stderr_tail(tmp_path):
    with service(tmp_path, breaker_restarts=3, breaker_window_s=3600.0) as svc:
        for _ in range(3):
            crash(svc)
            assert svc.recover() is True
        last_pid = svc.pid
        crash(svc)
        with pytest.raises(CircuitOpen) as err:
            svc.recover()
        msg = str(err.value)
        assert isinstance(err.value, ServiceUnavailable)  # callers that catch that still stop
        assert msg.startswith("flaky: circuit open") and "after 3 restarts within 3600s" in msg
        assert "ops.breaker_restarts=3" in msg and str(tmp_path / "svc.log") in msg
        assert msg.rstrip().endswith(f"RuntimeError: poisoned request in pid {last_pid}")  # the stderr tail
        assert len(msg.split("Last lines of")[1].splitlines()) <= 1 + 20
        assert [r.exit_code for r in svc.restart_history] == [3, 3, 3] and svc.restarts == 3
        # Open for good: asked again, it refuses without starting anything.
        with pytest.raises(CircuitOpen, match="circuit open"):
            svc.ensure_alive()
        assert not svc.alive() and svc.restarts == 3 and svc.breaker_open


@pytest.mark.slow
def test_a_service_that_crashes_rarely_never_trips(tmp_path):
    now = [1000.0]  # the supervisor's clock, moved by the test: crashes hours apart without waiting hours
    with service(tmp_path, breaker_restarts=1, breaker_window_s=60.0, clock=lambda: now[0]) as svc:
        for _ in range(4):
            now[0] += 61.0  # each crash comes after the window of the previous restart has passed
            crash(svc)
            assert svc.recover() is True
            assert httpx.get(f"{svc.url}/echo?x=up").text == "up"
        assert svc.restarts == 4 and not svc.breaker_open
        assert [r.at for r in svc.restart_history] == [1061.0, 1122.0, 1183.0, 1244.0]
        now[0] += 30.0  # but one within the window of the last restart trips it
        crash(svc)
        with pytest.raises(CircuitOpen, match="after 1 restarts within 60s"):
            svc.recover()
        assert svc.restarts == 4


def test_a_service_dying_at_startup_shows_its_last_log_lines(tmp_path):
    argv = [sys.executable, "-c", "import sys; sys.stderr.write('fatal: no config\\n'); raise SystemExit(3)"]
    bad = ServiceProcess("broken", argv, log_path=tmp_path / "broken.log", startup_timeout=10)
    with pytest.raises(ServiceUnavailable, match="(?s)exited with code 3.*fatal: no config"):
        bad.start()


def test_breaker_settings_are_checked():
    with pytest.raises(ValueError, match="breaker_restarts must be >= 1"):
        ServiceProcess("x", ["true"], breaker_restarts=0)


@pytest.mark.slow
def test_watchdog_kills_a_service_that_stops_answering_and_the_next_call_restarts_it(tmp_path):
    import os
    import signal
    import time

    with service(tmp_path, hang_timeout_s=3.0, heartbeat_s=0.5) as svc:
        hung_pid = svc.pid
        os.kill(hung_pid, signal.SIGSTOP)  # a real hang: alive, silent
        deadline = time.monotonic() + 30
        while svc.hangs == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.hangs == 1 and not svc.alive()
        assert svc.recover() is True and svc.pid != hung_pid
        assert httpx.get(f"{svc.url}/echo?x=back").text == "back"
        assert svc.hangs == 1  # a healthy, answering service is left alone
    assert "not answered" not in (tmp_path / "svc.log").read_text()


class Flaky:
    """A call that fails `failures` times with `error`, then answers."""

    def __init__(self, failures: int, error: type[BaseException] = ConnectionError):
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"failure {self.calls}")
        return "ok"


def test_retry_runs_between_after_each_failed_attempt_but_the_last():
    seen, slept = [], []
    call = Flaky(2)
    assert retry(call, attempts=3, on=ConnectionError, between=lambda n, e: seen.append((n, str(e))),
                 sleep=slept.append) == "ok"
    assert call.calls == 3 and seen == [(1, "failure 1"), (2, "failure 2")]
    assert slept == []  # no wait given: no pause, not even of 0 s


def test_retry_raises_the_last_error_unchanged_or_give_up_from_it():
    call = Flaky(5)
    with pytest.raises(ConnectionError, match="failure 3"):
        retry(call, attempts=3, on=ConnectionError)
    assert call.calls == 3
    with pytest.raises(ServiceUnavailable, match="svc: 2 attempts failed; last: ConnectionError") as info:
        retry(Flaky(5), attempts=2, on=(ConnectionError, TimeoutError),
              give_up=lambda e: ServiceUnavailable(f"svc: 2 attempts failed; last: {e!r}"))
    assert isinstance(info.value.__cause__, ConnectionError)


def test_retry_lets_other_errors_through_at_once():
    call, seen = Flaky(1, ValueError), []
    with pytest.raises(ValueError, match="failure 1"):
        retry(call, attempts=3, on=ConnectionError, between=lambda n, e: seen.append(n))
    assert call.calls == 1 and seen == []
    conflict = Flaky(1, KeyError)
    assert retry(conflict, attempts=2, on=lambda e: isinstance(e, KeyError)) == "ok"  # a predicate picks them


def test_retry_without_a_limit_and_its_waits():
    call, slept = Flaky(40), []
    assert retry(call, attempts=None, on=ConnectionError, sleep=slept.append,
                 wait=tenacity.wait_exponential(multiplier=0.1, max=5.0)) == "ok"
    delay, expected = 0.1, []
    for _ in range(40):  # the schedule the sandbox pool had by hand: 0.1 s doubling, at most 5 s
        expected.append(delay)
        delay = min(delay * 2, 5.0)
    assert slept == expected


def test_a_picked_port_taken_before_the_child_binds_it_is_replaced_at_first_start(tmp_path, monkeypatch):
    from factory.infra import supervisor

    with socket.socket() as other:  # other work takes the port the supervisor picks, before its child binds it
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        picks = iter([taken, supervisor.free_port()])
        monkeypatch.setattr(supervisor, "free_port", lambda: next(picks))
        with service(tmp_path) as svc:
            assert svc.port != taken and httpx.get(f"{svc.url}/echo?x=hi").text == "hi"
            assert svc.argv[2] == str(svc.port) and svc.restarts == 0
        assert "Address already in use" in (tmp_path / "svc.log").read_text()  # the first child's death
        monkeypatch.setattr(supervisor, "free_port", lambda: taken)  # every pick taken: the error, after PORT_TRIES
        with pytest.raises(ServiceUnavailable, match="exited with code"):
            service(tmp_path).start()
