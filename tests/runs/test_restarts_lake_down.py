"""The restarts supervisor outlives a lake outage: attempts that crash while the SQLite catalog's write lock is
held by another connection (commits fail: `database is locked`) cannot be recorded, and the supervisor says so
and goes on restarting, instead of dying of the lake's error as it did. The attempts are real processes that exit
with a crash's code at once (what an attempt does is not under test here)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

from factory.config import parse_spec
from factory.runs import recovery, restarts
from factory.runs.exit_codes import EXIT_FAILED


def test_the_supervisor_survives_a_lake_error_while_recording_a_dead_attempt(factory_home, lake, monkeypatch):
    spec = parse_spec({"name": "sup", "model": {"preset": "micro"}, "ops": {"max_restarts": 1, "preflight": "off"}})
    lake.upsert("runs", [dict(run_id="sup-1", name="sup", status="running", spec=spec.to_json(),
                              spec_fingerprint=spec.fingerprint(), code_version="c", seed=0, started_at=recovery.now(),
                              host=recovery.host(), attempts=1)])
    started: list[int] = []

    def crashing_attempt(self, attempt: int, warm: bool) -> subprocess.Popen:
        started.append(attempt)
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

    monkeypatch.setattr(restarts._Attempts, "start", crashing_attempt)
    said: list[str] = []
    outage = sqlite3.connect(factory_home.catalog_db, isolation_level=None)
    outage.execute("BEGIN EXCLUSIVE")
    try:
        rc = restarts.supervise(factory_home, "sup-1", spec, log=said.append, warm_standby=False)
    finally:
        outage.execute("ROLLBACK")
        outage.close()
    assert rc == EXIT_FAILED and started == [1, 2]
    assert sum("could not record the dead attempt in the lake (OperationalError" in line for line in said) == 2
    assert any("restart 1 of 1" in line for line in said)
    assert any("restarts are used up; resume it by hand with: factory resume sup-1" in line for line in said)
    (row,) = lake.read("runs").to_pylist()
    assert row["status"] == "running"  # unrecorded: the next attempt (or factory resume) marks it dead
