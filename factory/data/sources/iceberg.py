"""A source over an Iceberg table, pinned to one snapshot: its version is the snapshot id.

The snapshot's data files are planned once and put in a fixed order (by path), with each file's row count
(from the manifest, or counted once for a file with delete files), so a block maps to the files it
overlaps. A block streams those files' record batches through pyiceberg's Arrow reader (projection, schema
evolution and deletes applied); a sequential reader continues the open stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan

from factory.problem import Problem
from factory.source_spec import ColumnMap, SourceError

from .rows import BatchCursor, check_verifier, problems_from_arrow


class IcebergSource:
    """Table `table` ("namespace.name") of `catalog` at `snapshot_id` (default: its current snapshot, pinned)."""

    def __init__(self, name: str, catalog: Catalog, table: str, verifier: str, snapshot_id: int | None = None,
                 columns: ColumnMap | dict | None = None, block_rows: int = 1024):
        if block_rows < 1:
            raise SourceError(f"source {name!r}: block_rows must be >= 1, got {block_rows}")
        check_verifier(name, verifier)
        self.name, self.table_name, self.verifier, self.block_rows = name, table, verifier, block_rows
        try:
            tbl = catalog.load_table(table)
        except (NoSuchTableError, NoSuchNamespaceError) as e:
            raise SourceError(f"source {name!r}: Iceberg table {table!r} does not exist ({e})") from e
        if snapshot_id is None:
            snap = tbl.current_snapshot()
            if snap is None:
                raise SourceError(f"source {name!r}: Iceberg table {table!r} has no snapshot (no rows written)")
        else:
            snap = tbl.snapshot_by_id(snapshot_id)
            if snap is None:
                ids = [s.snapshot_id for s in tbl.snapshots()][-5:]
                raise SourceError(f"source {name!r}: Iceberg table {table!r} has no snapshot {snapshot_id}; its "
                                  f"latest are {ids}")
        self.snapshot_id = snap.snapshot_id
        cm = columns if isinstance(columns, ColumnMap) else ColumnMap.model_validate(columns or {})
        names = tbl.scan(snapshot_id=self.snapshot_id).projection().column_names
        self.columns = cm.resolve(name, f"Iceberg table {table!r}", names)
        scan = tbl.scan(snapshot_id=self.snapshot_id, selected_fields=tuple(self.columns.wanted()))
        self._scan = ArrowScan(tbl.metadata, tbl.io, scan.projection(), AlwaysTrue())
        self._tasks = sorted(scan.plan_files(), key=lambda t: t.file.file_path)
        self._starts = [0]
        for t in self._tasks:
            rows = t.file.record_count if not t.delete_files else sum(
                b.num_rows for b in self._scan.to_record_batches([t]))
            self._starts.append(self._starts[-1] + rows)
        self._n = self._starts[-1]
        if self._n == 0:
            raise SourceError(f"source {name!r}: Iceberg table {table!r} has no rows at snapshot {self.snapshot_id}")
        self._rows = BatchCursor(self._starts, self._open_file)

    def __len__(self) -> int:
        return self._n

    def version(self) -> str:
        return str(self.snapshot_id)

    def _open_file(self, f: int) -> Iterator[pa.RecordBatch]:
        return iter(b for b in self._scan.to_record_batches([self._tasks[f]]) if b.num_rows)

    def read_block(self, block: int) -> list[Problem]:
        n_blocks = -(-self._n // self.block_rows)
        if not 0 <= block < n_blocks:
            raise IndexError(f"source {self.name!r}: block {block} out of range (0..{n_blocks - 1})")
        start = block * self.block_rows
        end = min(start + self.block_rows, self._n)
        return problems_from_arrow(self._rows.read(start, end), self.columns, self.name, self.verifier, start)
