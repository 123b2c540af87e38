"""Sources over files: JSONL, Parquet, and a Hugging Face `datasets` directory written by `save_to_disk`.

None of them loads its file: Parquet reads only the row groups a block overlaps (streamed in batches, so a
large row group costs time, not memory); JSONL keeps the byte offset of each block's first line (one int
per block, found in one pass that also hashes the file) and seeks; a `save_to_disk` directory is Arrow IPC
streams, memory-mapped, so its record batches are views of the page cache, not copies. The `datasets`
package is not needed. A file source's version is the sha256 of its bytes (streamed).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from factory.problem import Problem
from factory.source_spec import ColumnMap, SourceError

from .rows import BatchCursor, check_verifier, problems_from_arrow, problems_from_columns

_HASH_CHUNK = 1 << 20


def _sha256_files(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:16]


class _FileSource:
    def __init__(self, name: str, path: str | Path, verifier: str, columns: ColumnMap | dict | None,
                 block_rows: int, what: str):
        self.name, self.path, self.verifier, self.block_rows = name, Path(path), verifier, block_rows
        if block_rows < 1:
            raise SourceError(f"source {name!r}: block_rows must be >= 1, got {block_rows}")
        if not self.path.exists():
            raise SourceError(f"source {name!r}: {what} {str(self.path)!r} does not exist")
        check_verifier(name, verifier)
        self.columns = columns if isinstance(columns, ColumnMap) else ColumnMap.model_validate(columns or {})
        self._n = 0
        self._version: str | None = None

    def __len__(self) -> int:
        return self._n

    def _empty_check(self) -> None:
        if self._n == 0:
            raise SourceError(f"source {self.name!r}: {str(self.path)!r} has no rows")

    def _block_range(self, block: int) -> tuple[int, int]:
        n_blocks = -(-self._n // self.block_rows)
        if not 0 <= block < n_blocks:
            raise IndexError(f"source {self.name!r}: block {block} out of range (0..{n_blocks - 1})")
        start = block * self.block_rows
        return start, min(start + self.block_rows, self._n)


class JsonlSource(_FileSource):
    """One JSON object per line (blank lines skipped); keys are the columns."""

    def __init__(self, name: str, path: str | Path, verifier: str, columns: ColumnMap | dict | None = None,
                 block_rows: int = 1024):
        super().__init__(name, path, verifier, columns, block_rows, "JSONL file")
        self._offsets: list[int] = []  # byte offset of each block's first line
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            pos = 0
            for line in f:
                h.update(line)
                if line.strip():
                    if self._n % block_rows == 0:
                        self._offsets.append(pos)
                    self._n += 1
                pos += len(line)
        self._version = h.hexdigest()[:16]
        self._empty_check()
        first = self._parse(self._lines(0, 1), 0)[0]
        self.columns = self.columns.resolve(name, f"{str(self.path)!r} (line 1)", list(first))

    def version(self) -> str:
        assert self._version is not None
        return self._version

    def _lines(self, block: int, count: int) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            f.seek(self._offsets[block])
            got = 0
            for line in f:
                if got == count:
                    return
                if line.strip():
                    got += 1
                    yield line

    def _parse(self, lines: Iterator[bytes], first_row: int) -> list[dict]:
        out = []
        for i, line in enumerate(lines):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(f"source {self.name!r}: row {first_row + i} of {str(self.path)!r} is not JSON: "
                                  f"{e}") from e
            if not isinstance(obj, dict):
                raise SourceError(f"source {self.name!r}: row {first_row + i} of {str(self.path)!r} is not a JSON "
                                  f"object (got {type(obj).__name__})")
            out.append(obj)
        return out

    def read_block(self, block: int) -> list[Problem]:
        start, end = self._block_range(block)
        records = self._parse(self._lines(block, end - start), start)
        cm = self.columns
        missing = [(start + i, c) for i, r in enumerate(records) for c in cm.wanted() if c not in r]
        if missing:
            row, col = missing[0]
            raise SourceError(f"source {self.name!r}: row {row} of {str(self.path)!r} has no column {col!r}")
        cols = {c: [r[c] for r in records] for c in cm.wanted()}
        return problems_from_columns(cols, len(records), cm, self.name, self.verifier, start)


class ParquetSource(_FileSource):
    """A Parquet file, or a directory of them (its *.parquet files, recursively, in path order, as one source:
    a sharded data set); a block reads the row groups it overlaps, only the mapped columns, in batches."""

    def __init__(self, name: str, path: str | Path, verifier: str, columns: ColumnMap | dict | None = None,
                 block_rows: int = 1024):
        super().__init__(name, path, verifier, columns, block_rows, "Parquet file")
        self._files = sorted(self.path.rglob("*.parquet")) if self.path.is_dir() else [self.path]
        if not self._files:
            raise SourceError(f"source {name!r}: directory {str(self.path)!r} holds no .parquet file")
        self._groups: list[tuple[int, int]] = []  # (file, row group) in source order
        self._group_starts = [0]
        for f, file in enumerate(self._files):
            try:
                md = pq.read_metadata(file)
            except (pa.ArrowInvalid, OSError) as e:
                raise SourceError(f"source {name!r}: {str(file)!r} is not a readable Parquet file: {e}") from e
            cols = md.schema.to_arrow_schema().names
            self.columns = self.columns.resolve(name, repr(str(file)), cols) if f == 0 else self.columns
            missing = [c for c in self.columns.wanted() if c not in cols]
            if missing:
                raise SourceError(f"source {name!r}: {str(file)!r} has no column {', '.join(map(repr, missing))}; "
                                  f"its columns are {', '.join(map(repr, cols))}")
            for g in range(md.num_row_groups):
                if md.row_group(g).num_rows:
                    self._groups.append((f, g))
                    self._group_starts.append(self._group_starts[-1] + md.row_group(g).num_rows)
        self._n = self._group_starts[-1]
        self._empty_check()
        self._open: tuple[int, pq.ParquetFile] | None = None  # one file open at a time (shards may be many)
        # A sequential reader (the common case) continues the open batch stream of a row group instead of
        # decoding the group again from its start: (group, batch stream, current batch, its first row).
        # Row groups streamed in batches (a large group costs time, not memory), forward from where the last read
        # stopped when it can.
        self._rows = BatchCursor(self._group_starts, self._open_group)

    def version(self) -> str:
        if self._version is None:
            self._version = _sha256_files(self._files)
        return self._version

    def _parquet_file(self, f: int) -> pq.ParquetFile:
        if self._open is None or self._open[0] != f:
            if self._open is not None:
                self._open[1].close()
            self._open = (f, pq.ParquetFile(self._files[f]))
        return self._open[1]

    def _open_group(self, g: int) -> Iterator[pa.RecordBatch]:
        f, group = self._groups[g]
        return self._parquet_file(f).iter_batches(batch_size=min(self.block_rows, 65536), row_groups=[group],
                                                  columns=self.columns.wanted(), use_threads=False)

    def read_block(self, block: int) -> list[Problem]:
        start, end = self._block_range(block)
        return problems_from_arrow(self._rows.read(start, end), self.columns, self.name, self.verifier, start)


class HFDiskSource(_FileSource):
    """A directory written by `datasets.Dataset.save_to_disk` (or one split of a `DatasetDict`'s): Arrow IPC
    stream files listed in its state.json."""

    def __init__(self, name: str, path: str | Path, verifier: str, columns: ColumnMap | dict | None = None,
                 split: str | None = None, block_rows: int = 1024):
        super().__init__(name, path, verifier, columns, block_rows, "dataset directory")
        root = self.path
        if (root / "dataset_dict.json").exists():
            splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
            if split not in splits:
                raise SourceError(f"source {name!r}: {str(root)!r} is a DatasetDict; set split to one of "
                                  f"{', '.join(map(repr, splits))} (got {split!r})")
            root = root / split
        elif split is not None:
            raise SourceError(f"source {name!r}: {str(root)!r} is a single dataset (no dataset_dict.json); "
                              f"remove split={split!r}")
        state_file = root / "state.json"
        if not state_file.exists():
            raise SourceError(f"source {name!r}: {str(root)!r} has no state.json: not a directory written by "
                              "datasets' save_to_disk")
        state = json.loads(state_file.read_text())
        self._files = [root / f["filename"] for f in state.get("_data_files", [])]
        for f in self._files:
            if not f.exists():
                raise SourceError(f"source {name!r}: data file {str(f)!r} listed in state.json does not exist")
        if state.get("_indices_data_files"):
            raise SourceError(f"source {name!r}: {str(root)!r} holds an indices mapping; flatten_indices() before "
                              "save_to_disk")
        # Zero-copy: each batch is a view of the memory-mapped file, so holding them costs no heap.
        self._batches: list[pa.RecordBatch] = []
        schema = None
        for f in self._files:
            try:
                reader = pa.ipc.open_stream(pa.memory_map(str(f), "r"))
            except pa.ArrowInvalid as e:
                raise SourceError(f"source {name!r}: {str(f)!r} is not an Arrow IPC stream: {e}") from e
            schema = schema or reader.schema
            self._batches.extend(b for b in reader if b.num_rows)
        self._batch_starts = [0]
        for b in self._batches:
            self._batch_starts.append(self._batch_starts[-1] + b.num_rows)
        self._n = self._batch_starts[-1]
        self._empty_check()
        self.columns = self.columns.resolve(name, repr(str(root)), schema.names if schema else [])

    def version(self) -> str:
        if self._version is None:
            self._version = _sha256_files(self._files)
        return self._version

    def read_block(self, block: int) -> list[Problem]:
        start, end = self._block_range(block)
        i = bisect.bisect_right(self._batch_starts, start) - 1
        parts = []
        while start < end:
            b, pos = self._batches[i], self._batch_starts[i]
            hi = min(end, pos + b.num_rows)
            parts.append(b.slice(start - pos, hi - start).select(self.columns.wanted()))
            start, i = hi, i + 1
        return problems_from_arrow(pa.Table.from_batches(parts), self.columns, self.name, self.verifier,
                                   block * self.block_rows)
