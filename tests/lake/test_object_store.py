"""The lake's warehouse on an object store ($FACTORY_WAREHOUSE_URI=s3://...): a SQLite SqlCatalog whose tables' data
and metadata files live in a bucket on a real S3 server (moto on 127.0.0.1), written and read through pyiceberg's
PyArrowFileIO, and read by `factory query`. Real AWS S3 and GCS are not exercised."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from factory.cli import main
from factory.lake import Lake, open_catalog


def _steps(run_id: str, n: int) -> list[dict]:
    at = datetime(2026, 1, 2, tzinfo=UTC)
    return [dict(run_id=run_id, step=s, weight_version=s, loss=1.0 / s, recorded_at=at) for s in range(1, n + 1)]


@pytest.mark.slow
def test_tables_live_in_the_bucket_and_read_back(factory_home, s3_server, monkeypatch, capsys):
    monkeypatch.setenv("FACTORY_WAREHOUSE_URI", f"s3://{s3_server.bucket}/team/lake/")
    with Lake.open(factory_home) as lake:
        lake.upsert("steps", _steps("r1", 3))
        lake.upsert("steps", _steps("r1", 2) + _steps("r2", 1))  # keyed: replaces r1's steps 1-2
        got = sorted((r["run_id"], r["step"]) for r in lake.read("steps").to_pylist())
    assert got == [("r1", 1), ("r1", 2), ("r1", 3), ("r2", 1)]

    keys = s3_server.keys("team/lake")
    steps = [k for k in keys if "/steps/" in k]
    assert any(k.endswith(".parquet") and "/data/" in k for k in steps), keys
    assert any(k.endswith(".metadata.json") for k in steps), keys
    assert open_catalog(factory_home).load_table("factory.steps").metadata_location.startswith(
        f"s3://{s3_server.bucket}/team/lake/")
    assert not [p for p in factory_home.warehouse.rglob("*") if p.is_file()]  # nothing written locally

    assert main(["query", "SELECT run_id, count(*) AS n FROM steps GROUP BY run_id ORDER BY run_id",
                 "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"run_id": "r1", "n": 3}, {"run_id": "r2", "n": 1}]


@pytest.mark.parametrize("bad", ["/data/warehouse", "http://minio:9000/bucket", "s3://", "s3://b/p?endpoint=x"])
def test_a_warehouse_uri_that_is_not_an_object_store_is_refused(factory_home, monkeypatch, bad):
    monkeypatch.setenv("FACTORY_WAREHOUSE_URI", bad)
    with pytest.raises(ValueError, match=r"FACTORY_WAREHOUSE_URI=.*expected"):
        open_catalog(factory_home)
