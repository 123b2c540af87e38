"""SQL over the lake with DuckDB, and the table / csv / json renderings."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math

import pyarrow as pa
import pytest

from factory.lake import Lake, QueryError, format_table, query
from factory.lake.query import referenced_tables

T0 = dt.datetime(2025, 3, 4, 5, 6, 7, 123456, tzinfo=dt.UTC)


@pytest.fixture
def filled(lake: Lake) -> Lake:
    for run_id, name in (("r1", "alpha"), ("r2", "beta")):
        lake.upsert("runs", [dict(run_id=run_id, name=name, spec="{}", spec_fingerprint="f", code_version="c",
                                  status="succeeded", seed=0, started_at=T0)])
    lake.upsert("steps", [dict(run_id="r1", step=s, weight_version=s, loss=1.0 / (s + 1), recorded_at=T0)
                          for s in range(4)])
    lake.upsert("steps", [dict(run_id="r2", step=0, weight_version=0, loss=5.0, recorded_at=T0)])
    return lake


def test_query_joins_runs_and_steps(filled: Lake):
    result = query("""
        SELECT r.name, count(*) AS n, min(s.loss) AS best_loss, max(s.recorded_at) AS last_at
        FROM steps s JOIN runs r USING (run_id) GROUP BY r.name ORDER BY r.name""", filled)
    assert isinstance(result, pa.Table)
    assert result.to_pylist() == [
        {"name": "alpha", "n": 4, "best_loss": 0.25, "last_at": T0},
        {"name": "beta", "n": 1, "best_loss": 5.0, "last_at": T0},
    ]


def test_only_named_tables_are_scanned():
    assert referenced_tables("SELECT step FROM steps WHERE step > 1") == ["steps"]
    assert referenced_tables("select * from RUNS r join evals e using (run_id)") == ["runs", "evals"]
    assert referenced_tables("SELECT 1 AS step") == []


@pytest.mark.slow
def test_bad_sql_and_unknown_table_raise_query_error(filled: Lake):
    with pytest.raises(QueryError, match="syntax error"):
        query("SELEC * FROM steps", filled)
    with pytest.raises(QueryError, match="nope"):
        query("SELECT * FROM nope", filled)
    with pytest.raises(QueryError, match="no_such_column"):
        query("SELECT no_such_column FROM steps", filled)


def test_an_unknown_table_is_named_with_the_lakes_tables():
    from factory.lake.schemas import TABLES

    # no lake table is named, so none is scanned: no lake is needed to get the error
    with pytest.raises(QueryError) as e:
        query("SELECT * FROM stepz", None)
    msg = str(e.value)
    assert "stepz does not exist" in msg and "\n" not in msg
    assert msg.endswith("The lake's tables: " + ", ".join(TABLES)) and "steps" in TABLES
    assert "sqlite_temp_master" not in msg  # DuckDB's suggestion, a table of its own catalog


def test_csv_round_trip(filled: Lake):
    tbl = query('SELECT run_id, step, loss, kl, recorded_at FROM steps ORDER BY run_id, step', filled)
    rows = list(csv.DictReader(io.StringIO(format_table(tbl, "csv"))))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "0"]
    assert [float(r["loss"]) for r in rows] == tbl["loss"].to_pylist()  # floats exactly
    assert rows[0]["kl"] == ""  # null
    assert dt.datetime.fromisoformat(rows[0]["recorded_at"]) == T0


def test_json_round_trip_with_iso_timestamps_and_nan_as_null():
    tbl = pa.table({"run_id": ["a", "b"], "loss": [0.5, math.nan], "n": [1, None],
                    "at": pa.array([T0, None], pa.timestamp("us", tz="UTC"))})
    rows = json.loads(format_table(tbl, "json"))
    assert rows == [{"run_id": "a", "loss": 0.5, "n": 1, "at": "2025-03-04T05:06:07.123456+00:00"},
                    {"run_id": "b", "loss": None, "n": None, "at": None}]


@pytest.mark.slow
def test_json_of_duckdb_aggregates(filled: Lake):
    tbl = query("SELECT sum(step) AS total, avg(loss) AS mean, count(*) AS n FROM steps", filled)
    assert json.loads(format_table(tbl, "json")) == [{"total": 6, "mean": pytest.approx(1.4166666), "n": 5}]


def test_table_format_aligns_columns():
    tbl = pa.table({"name": ["a", "longer-name"], "loss": [0.123456789, 12.5], "spec": ["x" * 200, None]})
    lines = format_table(tbl, "table").splitlines()
    header, rule, *body, footer = lines
    assert header.split() == ["name", "loss", "spec"] and set(rule.replace(" ", "")) == {"-"}
    assert footer == "(2 rows)"
    # Numbers are right-aligned: each value ends where the 'loss' column ends.
    loss_end = header.index("loss") + len("loss")
    assert body[0][:loss_end].endswith("0.1235") and body[1][:loss_end].endswith("12.5")
    assert len(body[0]) < 100 and body[0].endswith("…")  # long cells are cut


def test_table_format_rounds_each_column_to_what_its_name_says():
    """People read the table: accuracies to 3 decimals, seconds to 0.1 s (whole from 100 s), rates to 3 significant
    figures, the rest to 4; csv and json, for programs, keep every digit."""
    tbl = pa.table({"final_accuracy": [0.7790000000000001, 0.5], "wall_s": [93.4567, 1234.5],
                    "tokens_per_s": [12345.6, 0.012345], "goodput": [0.98765, 1.0], "kl": [0.000123456, 3.0]})
    header, _, first, second, _ = format_table(tbl, "table").splitlines()
    assert first.split() == ["0.779", "93.5", "12300", "0.988", "0.0001235"]
    assert second.split() == ["0.500", "1234", "0.0123", "1.000", "3"]
    assert "0.7790000000000001" in format_table(tbl, "csv") and "12345.6" in format_table(tbl, "json")


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError, match="unknown format 'xml'"):
        format_table(pa.table({"a": [1]}), "xml")  # type: ignore[arg-type]
