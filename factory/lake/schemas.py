"""The Iceberg tables of the `factory` namespace: one schema per table, its key, its partitioning,
its Arrow form.

This module is the single definition of what the lake holds. Writers, queries and tests all read
`TABLES`; nothing else spells a column name or type.

Partitioning, for growth (`TableDef.partition`):
- `steps`, `rollouts`, `evals`: `bucket(16, run_id)`. Every read and every keyed write of these
  tables names one run, so a run's files stay inside one partition and a scan of one run skips the
  other 15/16 of the files on partition values alone, before any column stats. A bucket rather than
  `identity(run_id)` keeps the partition count fixed however many runs accumulate (identity would
  make one directory, and at least one small file, per run). 16 rather than more: a one-machine lake
  holds tens to hundreds of runs, and upkeep already merges each run's small files into one.
- `node_health`: `day(recorded_at)`: it grows with time, not with runs, and is read by time window.
- `step_sources`, `prompt_attempts`: `bucket(16, run_id)` as well (per run).
- `runs`, `checkpoints`, `sweeps`, `prompt_stats`: unpartitioned; one row per run / checkpoint / sweep member is
  small however long the history.
Existing tables are moved to these specs by spec evolution (`catalog.ensure_tables`): files already
written keep their old (unpartitioned) spec and stay readable; new writes are partitioned.

Schema evolution: columns are only ever appended, optional, at the end of a definition; opening
the lake adds them to older tables with the field ids given here (see `_table`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.partitioning import PARTITION_FIELD_ID_START, PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import BucketTransform, DayTransform, IdentityTransform, Transform
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

# running: first attempt alive; resumed: a later attempt alive; interrupted: stopped by a signal, a hang or a
# crash with a resume point on disk (resumable); failed: stopped for good (or its process is gone); pruned: a tpe
# sweep's pruner stopped it at a resume point (an outcome, as in the `sweeps` table and on the MLflow run's
# `factory.status`; resumable too).
RUN_STATUSES = ("running", "resumed", "succeeded", "failed", "interrupted", "pruned")
# Why an attempt of a run ended early (the `interruptions` table).
# pruned: a tpe sweep's pruner stopped it (factory/cockpit/sweep_search.py); logprob_gap: the engine's and the trainer's
# log-probs disagreed past ops.max_logprob_gap (core/gate.py, at step 0 or for ops.max_gap_steps steps)
INTERRUPTION_CAUSES = ("killed", "signal", "hang", "crash", "crash_loop", "non_finite_loss", "failed_preflight",
                       "supervisor_lost", "pruned", "logprob_gap")
CHECKPOINT_KINDS = ("sft", "rl")


# Buckets of `run_id` for the per-run tables; see the module docstring for why 16.
RUN_BUCKETS = 16


@dataclass(frozen=True)
class PartitionBy:
    """One partition field: a transform of one column, e.g. bucket(16, run_id) or day(recorded_at)."""

    column: str
    transform: Transform

    @property
    def name(self) -> str:
        """pyiceberg's own naming (run_id_bucket_16, recorded_at_day): a spec created here and one
        evolved with `update_spec().add_field` name their fields alike. The bucket count is in the
        name, so changing it later adds a new field instead of clashing with the old one."""
        if isinstance(self.transform, BucketTransform):
            return f"{self.column}_bucket_{self.transform.num_buckets}"
        if isinstance(self.transform, IdentityTransform):
            return self.column
        return f"{self.column}_{self.transform}"


@dataclass(frozen=True)
class TableDef:
    """One lake table: its name, Iceberg schema, key (the columns a write is idempotent on) and
    partitioning (empty: unpartitioned)."""

    name: str
    schema: Schema
    key: tuple[str, ...]
    partition: tuple[PartitionBy, ...] = ()

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

    def partition_spec(self) -> PartitionSpec:
        """The Iceberg PartitionSpec of `partition`, with source ids from `schema`."""
        return PartitionSpec(*[
            PartitionField(source_id=self.schema.find_field(p.column).field_id, field_id=PARTITION_FIELD_ID_START + i,
                           transform=p.transform, name=p.name)
            for i, p in enumerate(self.partition)
        ])


def _table(name: str, key: tuple[str, ...], cols: list[tuple[str, IcebergType, bool]],
           partition: tuple[PartitionBy, ...] = ()) -> TableDef:
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
    for p in partition:
        # Partition by key columns only: they are required (no null partition), and the keyed delete
        # of an upsert filters on them, so it can skip the other partitions.
        if p.column not in key:
            raise AssertionError(f"{name}: partition column {p.column} must be a key column")
    return TableDef(name=name, schema=Schema(*fields, identifier_field_ids=ids), key=key, partition=partition)


# Short aliases keep the column lists readable: (name, type, required).
STR, LONG, DBL, BOOL, TS = StringType(), LongType(), DoubleType(), BooleanType(), TimestamptzType()
REQ, OPT = True, False
BY_RUN = (PartitionBy("run_id", BucketTransform(RUN_BUCKETS)),)
BY_DAY = (PartitionBy("recorded_at", DayTransform()),)

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
    # Added with resume and failure isolation (ops); appended so existing tables keep their field ids.
    ("attempts", LONG, OPT),  # attempts started (1 + restarts)
    ("restarts", LONG, OPT),  # attempts that resumed from a checkpoint
    ("interruptions", LONG, OPT),  # rows of `interruptions` for this run
    ("goodput", DBL, OPT),  # share of wall time spent on steps that count (see factory/ops/goodput.py)
    ("wall_s", DBL, OPT),  # summed over attempts
    ("host", STR, OPT),  # where the current attempt runs, and its pid: a reader can tell a dead run
    ("pid", LONG, OPT),
    ("heartbeat_at", TS, OPT),  # last sign of life of the current attempt
    ("error", STR, OPT),  # why it stopped, when it did not succeed
    ("lost_s", DBL, OPT),  # wall time lost to interruptions (redone steps, detection, recovery) and preflight
    ("device", STR, OPT),  # the current attempt's compute device, e.g. "cuda:0 (NVIDIA H100 80GB HBM3)"
])

# The columns `steps` gained with the sampler/trainer gap: the gap, its recompute's cost, the corrections' effect.
# `step_sources` has the first two per source (SOURCE_GAP_COLUMNS).
GAP_COLUMNS = ("gap_abs_mean", "gap_abs_max", "gap_kl", "gap_out_frac", "gap_seq_p95", "gap_rows", "recompute_s",
               "correction_weight_mean", "correction_masked_tokens", "correction_masked_seqs")
SOURCE_GAP_COLUMNS = ("gap_abs_mean", "gap_kl")
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
    # Added with ops: the attempt that recorded the step, samples whose scoring failed (scored 0), and
    # whether the step was skipped for a non-finite loss or gradient (1.0).
    ("attempt", LONG, OPT),
    *[(m, DBL, OPT) for m in ("env_errors", "nonfinite")],
    # Added with the data blender: share of generated tokens with a non-zero advantage.
    ("useful_token_share", DBL, OPT),
    # Added with reward integrity: completions of the step that tripped each reward-hack detector, and any.
    *[(m, DBL, OPT) for m in ("hacks_early_exit", "hacks_marker", "hacks_touched_tests", "hacks_any")],
    # Added with the run's metric panel: generated tokens per completion, averaged over the step's completions.
    ("response_tokens_mean", DBL, OPT),
    # Added with the sampler/trainer gap (factory/core/correction.py): the engine's log-probs of the batch against
    # the trainer's own under the same weights, what recomputing them cost, and what a correction did with them. NULL
    # where the step measured no row (the gap) or applied no correction (correction_*).
    *[(m, DBL, OPT) for m in GAP_COLUMNS],
], partition=BY_RUN)

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
], partition=BY_RUN)

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
    ("reason", STR, OPT),  # why the environment scored it 0 without judging it (raised, timed out, garbage)
    ("draw", LONG, OPT),  # the prompt stream's draw index: each draw is trained at most once, across resumes
    ("source", STR, OPT),  # the prompt source (data blend) the prompt came from
], partition=BY_RUN)

# Per step and prompt source: what the blend fed the trainer and how it scored (factory/data/feed.py).
STEP_SOURCES = _table("step_sources", ("run_id", "step", "source"), [
    ("run_id", STR, REQ),
    ("step", LONG, REQ),
    ("source", STR, REQ),
    ("groups", LONG, REQ),  # prompt groups of this source trained at this step
    ("reward_mean", DBL, OPT),
    ("accuracy", DBL, OPT),  # share of its samples that were exactly right
    ("tokens", LONG, OPT),  # generated tokens trained on
    ("useful_tokens", LONG, OPT),  # of those, tokens with a non-zero advantage (the rest teach nothing)
    ("skipped", LONG, OPT),  # prompts the curriculum skipped (not generated) since the previous step
    ("target_share", DBL, OPT),  # the blend's weight for it at this step
    ("recorded_at", TS, REQ),
    # Added with the sampler/trainer gap: the steps table's gap_abs_mean and gap_kl over this source's rows only.
    *[(m, DBL, OPT) for m in SOURCE_GAP_COLUMNS],
], partition=BY_RUN)

# One row per trained prompt group: the raw material of per-prompt statistics (`prompt_stats`).
PROMPT_ATTEMPTS = _table("prompt_attempts", ("run_id", "draw"), [
    ("run_id", STR, REQ),
    ("draw", LONG, REQ),  # the blend's draw id (unique within a run, across resumes)
    ("step", LONG, REQ),
    ("source", STR, REQ),
    ("prompt_id", STR, REQ),
    ("samples", LONG, REQ),
    ("passes", LONG, REQ),  # samples with reward >= 1
    ("reward_mean", DBL, REQ),
    ("reward_std", DBL, REQ),  # 0: every sample scored the same, the group taught nothing
    ("recorded_at", TS, REQ),
], partition=BY_RUN)

# Per prompt, over every finished run: what the offline curriculum filters on (data.filter).
PROMPT_STATS = _table("prompt_stats", ("source", "prompt_id"), [
    ("source", STR, REQ),
    ("prompt_id", STR, REQ),
    ("attempts", LONG, REQ),  # samples generated for it
    ("passes", LONG, REQ),
    ("groups", LONG, REQ),
    ("runs", LONG, REQ),
    ("pass_rate", DBL, REQ),
    ("last_run_id", STR, OPT),
    ("updated_at", TS, REQ),
])

NODE_HEALTH = _table("node_health", ("node", "check", "recorded_at"), [
    ("node", STR, REQ),
    ("check", STR, REQ),
    ("value", DBL, OPT),
    ("expected", STR, OPT),
    ("passed", BOOL, REQ),
    ("recorded_at", TS, REQ),
    # Added with preflight (factory/ops/preflight.py): one row per check per preflight run.
    ("preflight_id", STR, OPT),  # one preflight run: all its checks share it
    ("mode", STR, OPT),  # quick | deep
    ("threshold", DBL, OPT),  # the numeric floor or ceiling `value` was held to, if any
    ("unit", STR, OPT),
    ("duration_s", DBL, OPT),
    ("message", STR, OPT),  # what failed and what to do, or what was measured
], partition=BY_DAY)

INTERRUPTIONS = _table("interruptions", ("run_id", "attempt"), [
    ("run_id", STR, REQ),
    ("attempt", LONG, REQ),  # the attempt that was interrupted
    ("cause", STR, REQ),  # one of INTERRUPTION_CAUSES
    ("detail", STR, OPT),  # the error, the signal, the service and its last stderr lines
    ("last_step", LONG, OPT),  # last step the attempt recorded
    ("resumed_from_step", LONG, OPT),  # the checkpoint the next attempt started from
    ("steps_lost", LONG, OPT),  # last_step - resumed_from_step: steps trained again
    ("failed_at", TS, OPT),  # last sign of life of the interrupted attempt
    ("detect_s", DBL, OPT),  # failure -> noticed
    ("recover_s", DBL, OPT),  # noticed -> the next attempt starts its first step (restart, load, restore)
    ("redo_s", DBL, OPT),  # work of the interrupted attempt after its resume point, lost and done again
    ("recorded_at", TS, REQ),
], partition=BY_RUN)

# refused: by the preflight gate; pruned: stopped at a resume point by a tpe sweep's pruner (`reason` says why);
# interrupted: stopped at a resume point (its run worker died): Dagster's run retry resumes it
SWEEP_STATUSES = ("queued", "running", "succeeded", "failed", "refused", "pruned", "interrupted")
SWEEPS = _table("sweeps", ("sweep_id", "member"), [
    ("sweep_id", STR, REQ),
    ("member", STR, REQ),  # the member's partition key of the sweep-member asset
    ("name", STR, REQ),  # the sweep's name
    ("axes", STR, REQ),  # JSON {spec field path: value} of this member
    ("spec", STR, REQ),  # the member's full ExperimentSpec as JSON
    ("status", STR, REQ),  # one of SWEEP_STATUSES
    ("run_id", STR, OPT),  # the member's training run (runs.run_id)
    ("mlflow_parent_run_id", STR, OPT),
    ("final_accuracy", DBL, OPT),
    ("created_at", TS, REQ),
    ("recorded_at", TS, REQ),
    ("reason", STR, OPT),  # why it did not run (refused: the preflight gate's one line) or was pruned
])

TABLES: dict[str, TableDef] = {t.name: t for t in (RUNS, STEPS, CHECKPOINTS, EVALS, ROLLOUTS, NODE_HEALTH, SWEEPS,
                                                   INTERRUPTIONS, STEP_SOURCES, PROMPT_ATTEMPTS, PROMPT_STATS)}


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
