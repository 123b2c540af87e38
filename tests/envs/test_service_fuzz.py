"""Schemathesis against the environment workers' OpenAPI schema (`factory env-serve`, a real process on
127.0.0.1): generated requests, valid and invalid, never get a 5xx; refusals have the error shape."""

from __future__ import annotations

import sys

import pytest

from factory.infra.supervisor import ServiceProcess
from tests.ports import refusing_port
from tests.schema_fuzz import fuzz_service, schemathesis


def _stay_local(case) -> None:
    """Generated URLs and import paths would reach the network or import arbitrary modules: pin them."""
    body = case.body if isinstance(case.body, dict) else {}
    if isinstance(body.get("rollout_url"), str):
        body["rollout_url"] = f"http://127.0.0.1:{refusing_port()}"
    holders = [body]
    if isinstance(body.get("episodes"), list):
        holders += [e for e in body["episodes"] if isinstance(e, dict)]
    for holder in holders:
        if isinstance(holder.get("env"), str) and ":" in holder["env"]:
            holder["env"] = "no_such_module_for_fuzzing:attr"


@pytest.mark.slow
@pytest.mark.skipif(schemathesis is None, reason="schemathesis (dev extra) not installed")
def test_schema_fuzzing_finds_no_server_error(tmp_path):
    argv = [sys.executable, "-m", "factory.cli", "env-serve", "--port", "{port}"]
    with ServiceProcess("env-serve", argv, log_path=tmp_path / "service.log", startup_timeout=120) as svc:
        counts = fuzz_service(svc.url, max_examples=20, prepare=_stay_local)
    assert counts["POST /score"] > 10 and counts["POST /episodes"] > 10, counts
