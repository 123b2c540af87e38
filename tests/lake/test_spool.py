"""The spool that rides out a lake outage, against a real SQLite catalog made unavailable for real: another
connection holds its write lock (BEGIN EXCLUSIVE), so commits fail with `database is locked` as they would with
a catalog server that stopped answering."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from factory.home import FactoryPaths
from factory.infra.disk import DiskFull
from factory.lake.spool import LakeDown, Spool, SpooledLake, is_outage
from factory.lake.writer import Lake


class CatalogOutage:
    """Holds the SQLite catalog's write lock while active: every commit of every other connection fails."""

    def __init__(self, db: Path):
        self.conn = sqlite3.connect(db, isolation_level=None)

    def __enter__(self) -> CatalogOutage:
        self.conn.execute("BEGIN EXCLUSIVE")
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.execute("ROLLBACK")
        self.conn.close()


def step_rows(run_id: str, steps: range) -> list[dict]:
    return [dict(run_id=run_id, step=s, weight_version=s, reward_mean=0.5, recorded_at="2026-01-01T00:00:00+00:00")
            for s in steps]


def run_row(status: str) -> dict:
    return dict(run_id="r", name="n", status=status, spec="{}", spec_fingerprint="f", code_version="c", seed=0,
                started_at="2026-01-01T00:00:00+00:00")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_rows_written_during_an_outage_are_spooled_and_flushed_once(factory_home: FactoryPaths, lake: Lake, tmp_path):
    clock = Clock()
    spool = Spool(tmp_path / "spool", clock=clock)
    spooled = SpooledLake(lambda: lake, spool, probe_every_s=10.0)
    spooled.upsert("steps", step_rows("r", range(1, 3)))  # the lake answers: straight in
    assert not spool.pending()
    with CatalogOutage(factory_home.catalog_db):
        spooled.upsert("steps", step_rows("r", range(3, 5)))  # fails, kept on disk
        clock.t = 1.0
        spooled.upsert("steps", step_rows("r", range(4, 7)))  # behind the first: spooled without trying the lake
        assert len(spool.pending()) == 2 and spool.down_since == 0.0 and spool.outage_s() == 1.0
        assert "locked" in spool.last_error
    assert sorted(r["step"] for r in lake.read("steps").to_pylist()) == [1, 2]
    clock.t = 20.0  # past the probe interval: the next write tries the lake, finds it back, flushes in order
    spooled.upsert("steps", step_rows("r", range(7, 8)))
    assert not spool.pending() and spool.down_since is None
    assert sorted(r["step"] for r in lake.read("steps").to_pylist()) == list(range(1, 8))


def test_a_replayed_entry_duplicates_nothing_and_the_last_write_of_a_key_wins(lake: Lake, tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.put("runs", [run_row("running")])
    spool.put("runs", [run_row("interrupted")])
    first = spool.pending()[0]
    kept = first.read_text()
    assert spool.flush(lake) == 2
    first.write_text(kept)  # as if killed between committing the entry and deleting it: replayed
    spool.flush(lake)
    assert [r["status"] for r in lake.read("runs").to_pylist()] == ["running"]  # replayed alone: keyed, once
    spool.put("runs", [run_row("interrupted")])
    spool.flush(lake)
    assert [r["status"] for r in lake.read("runs").to_pylist()] == ["interrupted"]


def test_drain_past_the_budget_raises_lake_down_with_one_line(factory_home: FactoryPaths, lake: Lake, tmp_path):
    clock = Clock()
    spool = Spool(tmp_path / "spool", clock=clock)
    spooled = SpooledLake(lambda: lake, spool)
    with CatalogOutage(factory_home.catalog_db):
        spooled.upsert("steps", step_rows("r", range(1, 2)))

        def later(s: float) -> None:  # each wait moves the spool's clock on
            clock.t += s

        with pytest.raises(LakeDown) as e:
            spooled.drain(3.0, sleep=later)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("lake unavailable for ") and "ops.lake_outage_s = 3" in msg
    assert "1 spooled write(s) kept under" in msg and len(spool.pending()) == 1
    spooled.drain(3.0)  # back: flushed
    assert [r["step"] for r in lake.read("steps").to_pylist()] == [1]


def test_a_bad_row_is_not_an_outage(lake: Lake, tmp_path):
    spool = Spool(tmp_path / "spool")
    with pytest.raises(ValueError, match="unknown column"):
        SpooledLake(lambda: lake, spool).upsert("steps", [dict(run_id="r", step=1, nope=1)])
    assert not spool.pending() and spool.down_since is None


def test_a_full_disk_under_the_spool_is_disk_full_not_an_outage(tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_FAULT_ENOSPC", "spool_write:1")
    spool = Spool(tmp_path / "spool")
    with pytest.raises(DiskFull) as e:
        spool.put("steps", step_rows("r", range(1, 2)))
    assert str(e.value) == f"disk full: {tmp_path / 'spool'}" and not is_outage(e.value)
    assert list((tmp_path / "spool").iterdir()) == []  # no torn temp file left
