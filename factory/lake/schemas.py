"""The Iceberg tables of the `factory` namespace: one schema per table, its key, its Arrow form.

This module is the single definition of what the lake holds. Writers, queries and tests all read
`TABLES`; nothing else spells a column name or type.

Partitioning: every table is unpartitioned for now. The volumes of one machine are small (a run
writes one `steps` row per trainer step), and a partition by `run_id` would multiply small files
without making local scans faster. Partitioning can be added later by spec evolution without
rewriting data (`identity(run_id)` on `steps`/`rollouts`, `day(recorded_at)` on `node_health`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.types import (
    BooleanType,
    DoubleType,
    IcebergType,
    LongType,
    NestedField,
    StringType,
    TimestamptzType,
)

NAMESPACE = "factory"

RUN_STATUSES = ("running", "succeeded", "failed")
CHECKPOINT_KINDS = ("sft", "rl")


@dataclass(frozen=True)
class TableDef:
    """One lake table: its name, Iceberg schema and key (the columns a write is idempotent on)."""

    name: str
    schema: Schema
    key: tuple[str, ...]

    @property
    def identifier(self) -> tuple[str, str]:
        return (NAMESPACE, self.name)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.schema.fields)

    @property
    def required(self) -> frozenset[str]:
        return frozenset(f.name for f in self.schema.fields if f.required)

    def to_arrow_schema(self) -> pa.Schema:
        return to_arrow_schema(self)


def _table(name: str, key: tuple[str, ...], cols: list[tuple[str, IcebergType, bool]]) -> TableDef:
    """Build a TableDef; field ids are the 1-based column positions, so they are explicit and stable.

    Append new columns at the end only: a field id must never be reused for another column.
    """
    fields = [NestedField(i, n, t, required=req) for i, (n, t, req) in enumerate(cols, start=1)]
    ids = [f.field_id for f in fields if f.name in key]
    missing = set(key) - {f.name for f in fields}
    if missing:
        raise AssertionError(f"{name}: key columns {sorted(missing)} not in schema")
    for f in fields:
        if f.name in key and not f.required:
            raise AssertionError(f"{name}: key column {f.name} must be required")
    return TableDef(name=name, schema=Schema(*fields, identifier_field_ids=ids), key=key)


# Short aliases keep the column lists readable: (name, type, required).
STR, LONG, DBL, BOOL, TS = StringType(), LongType(), DoubleType(), BooleanType(), TimestamptzType()
REQ, OPT = True, False

RUNS = _table("runs", ("run_id",), [
    ("run_id", STR, REQ),
    ("sweep_id", STR, OPT),
    ("name", STR, REQ),
    ("spec", STR, REQ),  # the full ExperimentSpec as JSON
    ("spec_fingerprint", STR, REQ),
    ("code_version", STR, REQ),
    ("status", STR, REQ),  # one of RUN_STATUSES
    ("seed", LONG, REQ),
    ("mlflow_run_id", STR, OPT),
    ("init_checkpoint", STR, OPT),
    ("final_checkpoint", STR, OPT),
    ("started_at", TS, REQ),
    ("ended_at", TS, OPT),
])

_STEP_METRICS = (
    "loss", "reward_mean", "reward_std", "accuracy", "kl", "entropy", "clip_frac", "grad_norm",
    "logprob_mismatch", "staleness_mean", "staleness_max", "tokens_per_s", "trainer_idle_fraction", "wall_s",
)
STEPS = _table("steps", ("run_id", "step"), [
    ("run_id", STR, REQ),
    ("step", LONG, REQ),
    ("weight_version", LONG, REQ),
    *[(m, DBL, OPT) for m in _STEP_METRICS],
    ("recorded_at", TS, REQ),
    # Added with the async core; appended so existing tables keep their field ids.
    *[(m, DBL, OPT) for m in ("generator_idle_fraction", "buffer_depth", "rejected", "corrected", "filtered")],
])

CHECKPOINTS = _table("checkpoints", ("run_id", "step"), [
    ("run_id", STR, REQ),
    ("step", LONG, REQ),
    ("kind", STR, REQ),  # one of CHECKPOINT_KINDS
    ("uri", STR, REQ),
    ("bytes", LONG, REQ),
    ("sha256", STR, REQ),
    ("blender_state", STR, OPT),  # JSON of the data blender's position, to resume the data stream
    ("recorded_at", TS, REQ),
])

EVALS = _table("evals", ("run_id", "step", "benchmark", "metric"), [
    ("run_id", STR, REQ),
    ("step", LONG, REQ),
    ("benchmark", STR, REQ),
    ("metric", STR, REQ),
    ("value", DBL, REQ),
    ("n", LONG, REQ),
    ("checkpoint_sha256", STR, OPT),
    ("recorded_at", TS, REQ),
])

ROLLOUTS = _table("rollouts", ("run_id", "step", "prompt_id", "sample"), [
    ("run_id", STR, REQ),
    ("step", LONG, REQ),
    ("prompt_id", STR, REQ),
    ("sample", LONG, REQ),
    ("prompt", STR, REQ),
    ("completion", STR, REQ),
    ("reward", DBL, REQ),
    ("weight_version", LONG, REQ),
    ("staleness", LONG, REQ),
    ("latency_s", DBL, REQ),
    ("recorded_at", TS, REQ),
])

NODE_HEALTH = _table("node_health", ("node", "check", "recorded_at"), [
    ("node", STR, REQ),
    ("check", STR, REQ),
    ("value", DBL, OPT),
    ("expected", STR, OPT),
    ("passed", BOOL, REQ),
    ("recorded_at", TS, REQ),
])

TABLES: dict[str, TableDef] = {t.name: t for t in (RUNS, STEPS, CHECKPOINTS, EVALS, ROLLOUTS, NODE_HEALTH)}


def table_def(name: str) -> TableDef:
    """The TableDef called `name`; ValueError listing the known tables otherwise."""
    try:
        return TABLES[name]
    except KeyError:
        raise ValueError(f"unknown lake table {name!r}; known: {', '.join(TABLES)}") from None


def to_arrow_schema(table: TableDef | str) -> pa.Schema:
    """The Arrow schema a write must match: Iceberg field ids in metadata, nullability from `required`,
    timestamps as timestamp[us, tz=UTC], strings as large_string as pyiceberg reads them back."""
    tdef = table_def(table) if isinstance(table, str) else table
    return schema_to_pyarrow(tdef.schema)
