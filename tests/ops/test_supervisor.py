"""Supervised services: health-gated start, restart after a kill, retry of an interrupted call."""

import sys
import threading
from pathlib import Path

import httpx
import pytest

from factory.ops.supervisor import ServiceProcess, ServiceUnavailable, retry_through_restarts

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
        assert retry_through_restarts(call, svc) == "answered"
        t.join(timeout=30)
        assert len(calls) == 2 and svc.restarts == 1


def test_a_service_that_cannot_start_fails_loudly(tmp_path):
    bad = ServiceProcess("broken", [sys.executable, "-c", "raise SystemExit(3)"], startup_timeout=10)
    with pytest.raises(ServiceUnavailable, match="broken: process exited with code 3"):
        bad.start()


def test_restart_budget_is_enforced(tmp_path):
    with service(tmp_path, max_restarts=1) as svc:
        svc.kill()
        svc.ensure_alive()
        svc.kill()
        with pytest.raises(ServiceUnavailable, match="already restarted 1 times"):
            svc.ensure_alive()
