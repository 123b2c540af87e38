"""SQL over the lake with DuckDB, and rendering results for people (table) and programs (csv, json).

Each lake table named in the SQL text is scanned once with pyiceberg and handed to an in-memory DuckDB
as Arrow; tables not named are never scanned. That suits the local lake (thousands to millions of
rows); at cluster scale point Trino/Spark at the same catalog instead.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import duckdb
import pyarrow as pa

from factory.lake.schemas import TABLES
from factory.lake.writer import Lake
from factory.numbers import shown
from factory.text import clip

Format = Literal["table", "csv", "json"]
FORMATS: tuple[str, ...] = ("table", "csv", "json")

# Word-boundary match, so the column `step` does not pull in the table `steps`. A table named only in
# a string literal or comment gets scanned for nothing, which is harmless.
_TABLE_RE = re.compile(r"\b(" + "|".join(sorted(TABLES, key=len, reverse=True)) + r")\b", re.IGNORECASE)

# Table format: long cells (a run's JSON spec) are cut so a row stays on one line.
MAX_CELL = 60


class QueryError(ValueError):
    """The SQL could not run: syntax error, unknown table or column, type error. Message is one line."""


def referenced_tables(sql: str) -> list[str]:
    """The lake tables whose names appear in `sql`, in TABLES order."""
    found = {m.group(1).lower() for m in _TABLE_RE.finditer(sql)}
    return [name for name in TABLES if name in found]


def query(sql: str, lake: Lake, params: Sequence[Any] | Mapping[str, Any] | None = None) -> pa.Table:
    """Run `sql` (DuckDB dialect) over the lake tables it names; the result as an Arrow table.
    `params` binds `?` (a sequence) or `$name` (a mapping) placeholders. QueryError for SQL DuckDB rejects."""
    con = connect(lake, referenced_tables(sql))
    try:
        return run_sql(con, sql, params)
    except QueryError as e:
        # DuckDB's own suggestion names its catalog's tables (`sqlite_temp_master`), never the lake's: list those.
        if isinstance(e.__cause__, duckdb.CatalogException) and "Table with name" in str(e):
            raise QueryError(f"{e} The lake's tables: {', '.join(TABLES)}") from e.__cause__
        raise
    finally:
        con.close()


def connect(lake: Lake, tables: Iterable[str]) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB session in UTC with each of `tables` registered under its name as an Arrow
    scan of the lake table: several statements over the same tables then cost one scan each."""
    con = duckdb.connect()
    try:
        con.execute("SET TimeZone = 'UTC'")  # timestamps come back in UTC, whatever the machine's zone
        for name in tables:
            con.register(name, lake.read(name))
    except BaseException:
        con.close()
        raise
    return con


def run_sql(con: duckdb.DuckDBPyConnection, sql: str,
            params: Sequence[Any] | Mapping[str, Any] | None = None) -> pa.Table:
    """Run `sql` on `con`; the result as Arrow (empty for a statement without one). QueryError, one line,
    for SQL DuckDB rejects."""
    try:
        rel = con.sql(sql, params=params)
    except duckdb.Error as e:
        raise QueryError(_one_line(e)) from e
    if rel is None:  # a statement without a result (SET, CREATE VIEW ...)
        return pa.table({})
    try:
        return rel.to_arrow_table()
    except duckdb.Error as e:  # some errors only surface when the result is computed
        raise QueryError(_one_line(e)) from e


def _one_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


# -- formatting ----------------------------------------------------------------------------------

def format_table(tbl: pa.Table, fmt: Format = "table") -> str:
    """Render `tbl`: 'table' aligned columns for a terminal, 'csv' with a header row, 'json' an array
    of row objects. Timestamps are ISO-8601; in json, NaN/inf become null (JSON has no NaN). Only 'table'
    rounds floats, each to what its column's name says it holds (`factory.numbers.shown`)."""
    if fmt == "table":
        return _as_text(tbl)
    if fmt == "csv":
        return _as_csv(tbl)
    if fmt == "json":
        rows = [{k: json_value(v) for k, v in row.items()} for row in tbl.to_pylist()]
        return json.dumps(rows, indent=None, ensure_ascii=False)
    raise ValueError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def json_value(v: Any) -> Any:
    """`v` (a value from an Arrow/DuckDB result, or nested dicts/lists of them) as plain JSON data."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):  # DuckDB's sum() of integers is a HUGEINT, arriving as decimal
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {k: json_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_value(x) for x in v]
    return v


def _csv_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, float):
        return repr(v)  # shortest repr round-trips exactly
    if isinstance(v, dict | list):
        return json.dumps(json_value(v))
    return str(v)


def _as_csv(tbl: pa.Table) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(tbl.column_names)
    for row in tbl.to_pylist():
        w.writerow([_csv_value(v) for v in row.values()])
    return buf.getvalue()


def _text_value(v: Any, column: str = "") -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return shown(v, column)  # rounded to what the column's name says it is (factory/numbers.py)
    if isinstance(v, dt.datetime):
        # Seconds are enough to read; the tz suffix says it is UTC.
        return v.isoformat(sep=" ", timespec="seconds")
    s = _csv_value(v).replace("\n", "\\n")
    return clip(s, MAX_CELL, mark="…", unit=None)


def _as_text(tbl: pa.Table) -> str:
    names = tbl.column_names
    numeric = [pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
               for t in tbl.schema.types]
    cells = [[_text_value(v, name) for name, v in row.items()] for row in tbl.to_pylist()]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(names), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    n = tbl.num_rows
    out.append(f"({n} row{'' if n == 1 else 's'})")
    return "\n".join(out)
