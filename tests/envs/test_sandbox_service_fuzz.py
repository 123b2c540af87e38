"""Schemathesis against the sandbox pool service's OpenAPI schema (`factory sandbox-serve`, a real process on
127.0.0.1, bubblewrap): generated requests, valid and invalid, never get a 5xx; refusals have the error shape; no
worker faults."""

from __future__ import annotations

import sys

import httpx
import pytest

from factory.infra.supervisor import ServiceProcess
from tests.schema_fuzz import fuzz_service, schemathesis


def _short_runs(case) -> None:
    """Generated code runs for real: keep each run's time limits small so the fuzz stays quick."""
    body = case.body if isinstance(case.body, dict) else {}
    limits = body.get("limits")
    if isinstance(limits, dict):
        for name in ("wall_s", "cpu_s"):
            if isinstance(limits.get(name), int | float) and not isinstance(limits[name], bool) \
                    and limits[name] > 2:
                limits[name] = 2


@pytest.mark.slow
@pytest.mark.skipif(schemathesis is None, reason="schemathesis (dev extra) not installed")
def test_schema_fuzzing_finds_no_server_error(tmp_path, require_sandbox):
    argv = [sys.executable, "-m", "factory.cli", "sandbox-serve", "--port", "{port}", "--size", "2"]
    with ServiceProcess("sandbox-serve", argv, log_path=tmp_path / "service.log") as svc:
        counts = fuzz_service(svc.url, max_examples=20, prepare=_short_runs)
        metrics = httpx.get(svc.url + "/metrics").json()
    assert counts["POST /run"] > 10, counts
    assert metrics["failures"] == 0 and metrics["executions"] > 0, metrics
