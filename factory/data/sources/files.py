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
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

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


MAX_LINE_BYTES = 16 << 20  # a JSONL line longer than this is not a prompt row (a binary file read as JSONL; a 200 MB
# row reached the tokenizer, which aborted the process)

_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def check_regular(name: str, path: Path, expected: str) -> None:
    """SourceError unless `path` is a regular file: a FIFO, a device or a socket would block the read or never end
    it. Told by stat, without opening it."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise SourceError(f"source {name!r}: {str(path)!r} cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        kind = next((what for test, what in _NOT_REGULAR if test(mode)), "not a regular file")
        raise SourceError(f"source {name!r}: {str(path)!r} is {kind}, not a regular file; {expected}")


def numbered_lines(f: BinaryIO, name: str, path: Path, number: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line) of each line of `f` from where it is (its line `number + 1`), reading at
    most MAX_LINE_BYTES + 1 bytes at a time: a longer line is a SourceError naming it, never held whole."""
    pos = f.tell()
    while line := f.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(line) > MAX_LINE_BYTES:
            raise SourceError(f"source {name!r}: line {number} of {str(path)!r} is longer than "
                              f"{MAX_LINE_BYTES >> 20} MiB: not a JSONL file of prompt rows")
        yield number, pos, line
        pos += len(line)


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
    """One JSON object per line (blank lines skipped); keys are the columns. Opening it reads every line once,
    bounded (a line past MAX_LINE_BYTES is refused, never held), hashing the file and reading each row as a problem
    (a JSON object with the mapped columns), one block in memory at a time; `on_block(problems, lines)` (if given)
    sees each block's problems and their line numbers. Errors name the file's line (1-based, blank lines counted)."""

    def __init__(self, name: str, path: str | Path, verifier: str, columns: ColumnMap | dict | None = None,
                 block_rows: int = 1024, on_block: Callable[[list[Problem], list[int]], None] | None = None):
        super().__init__(name, path, verifier, columns, block_rows, "JSONL file")
        if self.path.is_dir():
            raise SourceError(f"source {name!r}: {str(self.path)!r} is a directory; kind: jsonl expects one file")
        check_regular(name, self.path, "kind: jsonl expects a file of JSON lines")
        self._offsets: list[int] = []  # byte offset of each block's first row
        self._first_lines: list[int] = []  # and its line number
        h = hashlib.sha256()
        block: list[tuple[int, dict]] = []
        with open(self.path, "rb") as f:
            for number, pos, line in numbered_lines(f, name, self.path):
                h.update(line)
                if not line.strip():
                    continue
                row = self._row(line, number)
                if self._n == 0:
                    self.columns = self.columns.resolve(name, f"{str(self.path)!r} (line {number})", list(row))
                    self._wanted = self.columns.wanted()
                if self._n % block_rows == 0:
                    self._offsets.append(pos)
                    self._first_lines.append(number)
                block.append((number, row))
                self._n += 1
                if len(block) == block_rows:
                    self._block_done(block, self._n - len(block), on_block)
                    block = []
        if block:
            self._block_done(block, self._n - len(block), on_block)
        self._version = h.hexdigest()[:16]
        self._empty_check()

    def _block_done(self, block: list[tuple[int, dict]], start: int,
                    on_block: Callable[[list[Problem], list[int]], None] | None) -> None:
        problems = self._problems(block, start)
        if on_block is not None:
            on_block(problems, [number for number, _ in block])

    def version(self) -> str:
        assert self._version is not None
        return self._version

    def _lines(self, block: int, count: int) -> Iterator[tuple[int, bytes]]:
        """(line number, line) of the block's `count` rows."""
        with open(self.path, "rb") as f:
            f.seek(self._offsets[block])
            got = 0
            for number, _, line in numbered_lines(f, self.name, self.path, self._first_lines[block] - 1):
                if got == count:
                    return
                if line.strip():
                    got += 1
                    yield number, line

    def _row(self, line: bytes, number: int) -> dict:
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"source {self.name!r}: line {number} of {str(self.path)!r} is not JSON ({e}); kind: "
                              f"jsonl expects one JSON object per line") from None
        if not isinstance(obj, dict):
            raise SourceError(f"source {self.name!r}: line {number} of {str(self.path)!r} is not a JSON object (got "
                              f"{type(obj).__name__})")
        return obj

    def _problems(self, block: list[tuple[int, dict]], start: int) -> list[Problem]:
        """The rows (with their line numbers) of the block starting at row `start` as problems."""
        for number, row in block:
            missing = [c for c in self._wanted if c not in row]
            if missing:
                raise SourceError(f"source {self.name!r}: line {number} of {str(self.path)!r} has no column "
                                  f"{', '.join(map(repr, missing))}")
        cols = {c: [r[c] for _, r in block] for c in self._wanted}
        return problems_from_columns(cols, len(block), self.columns, self.name, self.verifier, start)

    def read_block(self, block: int) -> list[Problem]:
        start, end = self._block_range(block)
        # checked when opened; the file may have changed since
        return self._problems([(n, self._row(line, n)) for n, line in self._lines(block, end - start)], start)


class ParquetSource(_FileSource):
    """A Parquet file, or a directory of them (its *.parquet files, recursively, in path order, as one source:
    a sharded data set); a block reads the row groups it overlaps, only the mapped columns, in batches."""

    def __init__(self, name: str, path: str | Path, verifier: str, columns: ColumnMap | dict | None = None,
                 block_rows: int = 1024):
        super().__init__(name, path, verifier, columns, block_rows, "Parquet file")
        self._files = sorted(self.path.rglob("*.parquet")) if self.path.is_dir() else [self.path]
        if not self._files:
            raise SourceError(f"source {name!r}: directory {str(self.path)!r} holds no .parquet file")
        for file in self._files:
            check_regular(name, file, "kind: parquet expects a .parquet file or a directory of them")
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
        if not root.is_dir():
            check_regular(name, root, "kind: hf_disk expects a directory written by datasets' save_to_disk")
            raise SourceError(f"source {name!r}: {str(root)!r} is a file; kind: hf_disk expects a directory written "
                              "by datasets' save_to_disk")
        if (root / "dataset_dict.json").exists():
            check_regular(name, root / "dataset_dict.json", "a dataset's json files are regular files")
            splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
            if split not in splits:
                raise SourceError(f"source {name!r}: {str(root)!r} is a DatasetDict; set split to one of "
                                  f"{', '.join(map(repr, splits))} (got {split!r})")
            root = root / split
        elif split is not None:
            raise SourceError(f"source {name!r}: {str(root)!r} is a single dataset (no dataset_dict.json); "
                              f"remove split={split!r}")
        state_file = root / "state.json"
        if state_file.exists():
            check_regular(name, state_file, "a dataset's json files are regular files")
        if not state_file.exists():
            raise SourceError(f"source {name!r}: {str(root)!r} has no state.json: not a directory written by "
                              "datasets' save_to_disk")
        state = json.loads(state_file.read_text())
        self._files = [root / f["filename"] for f in state.get("_data_files", [])]
        for f in self._files:
            if not f.exists():
                raise SourceError(f"source {name!r}: data file {str(f)!r} listed in state.json does not exist")
            check_regular(name, f, "a dataset's data files are Arrow files")
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
