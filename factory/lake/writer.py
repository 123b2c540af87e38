"""Writing to and reading from the lake: `Lake`, idempotent keyed upserts, and small-file upkeep.

An upsert is one Iceberg transaction: delete the rows whose key is in the batch, append the batch.
Measured against pyiceberg's `Table.upsert` (which first scans the matching rows, diffs them, then
overwrites + appends) it costs the same for new keys and about half for rewritten keys, and it
accepts any batch size (we build a shallow key filter; `Table.upsert` builds one `Or` per row).
Concurrent writers: pyiceberg retries a commit that lost a race and validates (serializable) that no
file matching our key filter was added meanwhile; when that validation fails we redo the whole
upsert from the new head, which is always correct because it is keyed.

Every write is a commit that adds a data file, manifests and a snapshot, so after a few hundred
steps planning a scan would read hundreds of small files and each commit would copy an ever larger
metadata. `Lake.maintain` (run by `upsert` itself past a threshold) merges small data files, per
value of the first key column (per run), and expires old snapshots; both are best-effort and
lose a race gracefully. Replaced files stay on disk (no orphan-file removal yet).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import numbers
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import tenacity
from pyiceberg.catalog import Catalog
from pyiceberg.conversions import from_bytes
from pyiceberg.exceptions import CommitFailedException, ValidationException
from pyiceberg.expressions import AlwaysTrue, And, BooleanExpression, EqualTo, In, Or
from pyiceberg.io.pyarrow import ArrowScan, _dataframe_to_data_files
from pyiceberg.table import FileScanTask, Table
from pyiceberg.types import BooleanType, DoubleType, IcebergType, LongType, StringType, TimestamptzType

from factory.home import FactoryPaths
from factory.infra.supervisor import retry
from factory.lake.catalog import ensure_tables, open_catalog
from factory.lake.schemas import TableDef, table_def

log = logging.getLogger(__name__)

# Whole-operation retries on top of pyiceberg's own commit retries: a ValidationException (a
# concurrent writer touched files our delete depends on) is not retried by pyiceberg, but redoing
# the whole delete+append from the new head is always correct because it is keyed.
UPSERT_ATTEMPTS = 12
CONFLICTS = (CommitFailedException, ValidationException)
# After failed attempt n, a pause drawn uniformly from [0, min(0.5, 0.01 * 2**n)] s: writers that keep colliding
# fall out of step.
CONFLICT_WAIT = tenacity.wait_random_exponential(multiplier=0.02, max=0.5)

# Upkeep thresholds, measured on steps (1-row upserts): without upkeep an upsert costs 55 ms at first,
# 235 ms after 300 writes and 530 ms after 500 (pyiceberg deep-copies the metadata, which lists every
# snapshot, dozens of times per commit, and plans over every small file); with these it stays ~50 ms.
COMPACT_AFTER_FILES = 32
KEEP_SNAPSHOTS = 8
EXPIRE_MIN_AGE_S = 1.0
SMALL_FILE_BYTES = 32 * 1024 * 1024

class Lake:
    """The Iceberg tables of one catalog. Not thread-safe; open one per process or thread."""

    def __init__(self, catalog: Catalog, *, auto_maintain: bool = True) -> None:
        self.catalog = catalog
        self.auto_maintain = auto_maintain
        self._files_after_upkeep: dict[str, int] = {}
        ensure_tables(catalog)

    @classmethod
    def open(
        cls, paths: FactoryPaths | None = None, *, auto_maintain: bool = True, **catalog_props: str
    ) -> Lake:
        """The lake under `paths` (default: $FACTORY_HOME), or the catalog `catalog_props` describe."""
        return cls(open_catalog(paths, **catalog_props), auto_maintain=auto_maintain)

    def table(self, name: str) -> Table:
        """The current state of table `name` (loaded fresh: other processes may have committed)."""
        return self.catalog.load_table(table_def(name).identifier)

    def upsert(self, table: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Write `rows` keyed on the table's key: an existing row with the same key is replaced, so
        writing the same rows again changes nothing. Within `rows` the last row of a key wins.
        Returns the number of rows written. ValueError for unknown/missing columns or bad values."""
        tdef = table_def(table)
        data = to_arrow(tdef, rows)
        if data.num_rows == 0:
            return 0
        key_filter = key_filter_for(tdef, data)

        def write() -> None:
            tbl = self.table(table)
            with warnings.catch_warnings():
                # pyiceberg warns when the delete matches nothing: the normal case for new keys.
                warnings.filterwarnings("ignore", message="Delete operation did not match any records")
                with tbl.transaction() as tx:
                    tx.delete(key_filter)
                    tx.append(data)

        def conflicted(attempt: int, e: BaseException) -> None:
            log.debug("lake: upsert into %s conflicted (%s); retrying from the new head", table, e)

        retry(write, attempts=UPSERT_ATTEMPTS, on=CONFLICTS, between=conflicted, wait=CONFLICT_WAIT)
        if self.auto_maintain:
            try:
                self._maybe_maintain(table)
            except Exception:
                # The rows are committed; upkeep is an optimisation and must never fail the write.
                log.warning("lake: upkeep of %s failed", table, exc_info=True)
        return data.num_rows

    def delete(self, table: str, row_filter: str | BooleanExpression) -> None:
        """Delete the rows of `table` matching `row_filter` (e.g. the steps a dead attempt recorded past the
        resume point its successor starts from), retried like `upsert` on a concurrent commit."""
        def delete() -> None:
            tbl = self.table(table)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Delete operation did not match any records")
                tbl.delete(row_filter)

        retry(delete, attempts=UPSERT_ATTEMPTS, on=CONFLICTS, wait=CONFLICT_WAIT)

    def read(self, table: str, row_filter: str | BooleanExpression | None = None) -> pa.Table:
        """All rows of `table` matching `row_filter` (pyiceberg expression or string like "step >= 3")."""
        tbl = self.table(table)
        return tbl.scan(row_filter=row_filter if row_filter is not None else AlwaysTrue()).to_arrow()

    def maintain(self, table: str) -> bool:
        """Merge the table's small data files (per run) and expire old snapshots. Returns whether it
        compacted. Loses gracefully to a concurrent writer (upsert tries again on a later write)."""
        compacted = self._try(self._compact, table)
        self._try(self._expire_snapshots, table)
        return bool(compacted)

    @staticmethod
    def _try(step: Any, table: str) -> Any:
        try:
            return step(table)
        except (CommitFailedException, ValidationException) as e:
            log.debug("lake: %s of %s lost a race: %s", step.__name__.strip("_"), table, e)
            return None

    def close(self) -> None:
        engine = getattr(self.catalog, "engine", None)  # SqlCatalog holds a SQLAlchemy pool
        if engine is not None:
            engine.dispose()

    def __enter__(self) -> Lake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- upkeep ---------------------------------------------------------------------------------

    def _maybe_maintain(self, table: str) -> None:
        tbl = self.table(table)
        snap = tbl.current_snapshot()
        if snap is None or snap.summary is None:
            return
        n_files = int(snap.summary.get("total-data-files") or 0)
        # Count from what the last upkeep left, not from zero: a lake with many runs keeps one file per
        # run after compaction, and must not try again on every write.
        if n_files >= self._files_after_upkeep.get(table, 0) + COMPACT_AFTER_FILES:
            self._try(self._compact, table)
        if len(tbl.metadata.snapshots) > 3 * KEEP_SNAPSHOTS:
            self._try(self._expire_snapshots, table)

    def _compact(self, table: str) -> bool:
        tdef = table_def(table)
        tbl = self.table(table)
        if tbl.current_snapshot() is None:
            return False
        groups = _small_files_by_first_key(tbl, tdef)
        groups = {g: tasks for g, tasks in groups.items() if len(tasks) >= 2}
        total = int(tbl.current_snapshot().summary.get("total-data-files") or 0)  # type: ignore[union-attr]
        if not groups:
            self._files_after_upkeep[table] = total
            return False
        with tbl.transaction() as tx:
            # An overwrite naming the replaced files. On a concurrent commit pyiceberg checks that none
            # of them vanished and, conservatively, that no file was added; if so it raises and we
            # try again on a later write.
            with tx.update_snapshot().overwrite() as rewrite:
                n_in = n_out = 0
                for tasks in groups.values():
                    merged = ArrowScan(tbl.metadata, tbl.io, tbl.schema(), AlwaysTrue()).to_table(tasks)
                    # Sorted by key, so the merged file's min/max stats are tight for key deletes.
                    merged = merged.sort_by([(k, "ascending") for k in tdef.key])
                    for f in _dataframe_to_data_files(tx.table_metadata, merged, tbl.io, uuid.uuid4()):
                        rewrite.append_data_file(f)
                        n_out += 1
                    for task in tasks:
                        rewrite.delete_data_file(task.file)
                        n_in += 1
        self._files_after_upkeep[table] = total - n_in + n_out
        log.debug("lake: compacted %d files of %s into %d", n_in, table, n_out)
        return True

    def _expire_snapshots(self, table: str) -> None:
        # Keep the last KEEP_SNAPSHOTS, and any younger than EXPIRE_MIN_AGE_S: a concurrent writer's
        # transaction starts from a recent snapshot and must still find it when it commits. Expiry only
        # drops metadata; data files stay on disk, so a reader mid-scan never breaks.
        tbl = self.table(table)
        snaps = sorted(tbl.metadata.snapshots, key=lambda s: s.timestamp_ms)
        current = tbl.metadata.current_snapshot_id
        cutoff_ms = (time.time() - EXPIRE_MIN_AGE_S) * 1000
        old = [s.snapshot_id for s in snaps[:-KEEP_SNAPSHOTS]
               if s.snapshot_id != current and s.timestamp_ms < cutoff_ms]
        if old:
            try:
                tbl.maintenance.expire_snapshots().by_ids(old).commit()
            except ValueError as e:  # another process expired some of them first
                log.debug("lake: snapshot expiry of %s lost a race: %s", table, e)


def _small_files_by_first_key(tbl: Table, tdef: TableDef) -> dict[Any, list[FileScanTask]]:
    """Small data files grouped by the value of the table's first key column (run_id, node) when a
    file holds one value, else under None. Merging within a group keeps merged files to one run, so
    their stats never overlap another run's keys and writers of different runs never conflict."""
    field = tdef.schema.find_field(tdef.key[0])
    groups: dict[Any, list[FileScanTask]] = {}
    for task in tbl.scan().plan_files():
        f = task.file
        if f.file_size_in_bytes >= SMALL_FILE_BYTES or task.delete_files:
            continue
        lo, hi = (f.lower_bounds or {}).get(field.field_id), (f.upper_bounds or {}).get(field.field_id)
        value = from_bytes(field.field_type, lo) if lo is not None and lo == hi else None
        groups.setdefault(value, []).append(task)
    return groups


# -- rows → Arrow --------------------------------------------------------------------------------

def to_arrow(tdef: TableDef | str, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Validate and convert dict rows to an Arrow table of the table's exact schema.

    Missing optional columns become null. Keys repeated within `rows` keep the last row.
    ValueError (naming table and column) for an unknown column, a missing required value,
    or a value that does not fit the column's type.
    """
    tdef = table_def(tdef) if isinstance(tdef, str) else tdef
    known = set(tdef.columns)
    last: dict[tuple[Any, ...], dict[str, Any]] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{tdef.name}: row {i} is a {type(row).__name__}, expected a dict")
        unknown = [c for c in row if c not in known]
        if unknown:
            raise ValueError(
                f"{tdef.name}: unknown column {unknown[0]!r} in row {i}; columns: {', '.join(tdef.columns)}"
            )
        converted: dict[str, Any] = {}
        for field in tdef.schema.fields:
            value = row.get(field.name)
            if value is None:
                if field.required:
                    raise ValueError(f"{tdef.name}: missing required column {field.name!r} in row {i}")
                converted[field.name] = None
                continue
            try:
                converted[field.name] = _convert(field.field_type, value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{tdef.name}.{field.name} in row {i}: {e}") from None
        key = tuple(converted[k] for k in tdef.key)
        last.pop(key, None)  # re-insert so the batch keeps the order of each key's last write
        last[key] = converted
    columns = {name: [r[name] for r in last.values()] for name in tdef.columns}
    return pa.Table.from_pydict(columns, schema=tdef.to_arrow_schema())


def _convert(kind: IcebergType, value: Any) -> Any:
    if isinstance(kind, StringType):
        if isinstance(value, str):
            return value
        if isinstance(value, PurePath):
            return str(value)
        if isinstance(value, Mapping | list | tuple):
            return json.dumps(value, sort_keys=True, default=str)  # spec / blender state given as data
        raise TypeError(f"expected str, got {type(value).__name__}")
    if isinstance(kind, LongType):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"expected int, got {type(value).__name__}")
        if isinstance(value, numbers.Integral):
            return int(value)
        if float(value).is_integer():
            return int(value)
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(kind, DoubleType):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"expected float, got {type(value).__name__}")
        return float(value)  # NaN / inf are kept: they are facts about a step
    if isinstance(kind, BooleanType):
        if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy.bool_
            return bool(value)
        raise TypeError(f"expected bool, got {type(value).__name__}")
    if isinstance(kind, TimestamptzType):
        return to_utc(value)
    raise TypeError(f"unsupported column type {kind}")  # pragma: no cover - schemas use the types above


def to_utc(value: Any) -> dt.datetime:
    """A datetime in UTC from an aware datetime, a naive one (taken as UTC), or an ISO-8601 string."""
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    if not isinstance(value, dt.datetime):
        raise TypeError(f"expected datetime, got {type(value).__name__}")
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC)


# -- key filters ---------------------------------------------------------------------------------

def key_filter_for(tdef: TableDef, data: pa.Table) -> BooleanExpression:
    """An exact filter for the keys in `data`: rows grouped by all key columns but the last, which
    becomes an IN list. E.g. 100 steps of one run -> run_id = r AND step IN (...), not 100 ORs."""
    *prefix, last = tdef.key
    groups: dict[tuple[Any, ...], list[Any]] = {}
    cols = {k: _literal_values(data.column(k)) for k in tdef.key}
    for i in range(data.num_rows):
        groups.setdefault(tuple(cols[k][i] for k in prefix), []).append(cols[last][i])
    exprs: list[BooleanExpression] = []
    for pre, lasts in groups.items():
        leaf = EqualTo(last, lasts[0]) if len(lasts) == 1 else In(last, lasts)
        terms = [EqualTo(k, v) for k, v in zip(prefix, pre, strict=True)] + [leaf]
        exprs.append(terms[0] if len(terms) == 1 else And(*terms))
    return _balanced_or(exprs)


def _literal_values(col: pa.ChunkedArray) -> list[Any]:
    # Timestamps go into filters as epoch microseconds, the form pyiceberg binds to timestamptz.
    if pa.types.is_timestamp(col.type):
        return pc.cast(col, pa.int64()).to_pylist()
    return col.to_pylist()


def _balanced_or(exprs: list[BooleanExpression]) -> BooleanExpression:
    # Or(a, b, c, ...) nests to the right, one level per term; visitors recurse, so a batch of a few
    # thousand groups would hit the recursion limit. A balanced tree keeps the depth at log2(n).
    if len(exprs) == 1:
        return exprs[0]
    mid = len(exprs) // 2
    return Or(_balanced_or(exprs[:mid]), _balanced_or(exprs[mid:]))
