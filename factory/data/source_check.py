"""`check_sources(spec)`: what opening a spec's file sources would refuse, found before a run starts (by `factory
validate` and `factory run`): the file exists, is of the kind's format, has the mapped columns, and its first rows
read as problems. Cheap on large data: Parquet and `save_to_disk` sources read their metadata and first block only,
a JSONL source its first non-blank line (the whole file is read, and hashed, when the run opens it).

Generated sources (arithmetic, suite, reasoning_gym, humaneval) are checked with the spec (factory/envs/
spec_check.py); an Iceberg source needs the lake, and is checked when the run opens it.

Relative paths: a spec loaded from a file has them made absolute against the file's folder when it is loaded
(`factory.config.load_spec`); in a spec built in Python (or one given with `--set`), a relative `path:` is relative
to the working directory of the process that opens the source, as `open_sources` reads it by default.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from factory.config import FILE_SOURCE_KINDS, ExperimentSpec
from factory.source_spec import ColumnMap, SourceError, parse_source_spec

MAX_FIRST_LINE = 16 << 20  # a JSONL row longer than this is not a prompt row (a binary file read as JSONL)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def check_sources(spec: ExperimentSpec, base_dir: str | Path | None = None) -> None:
    """SourceError (one line, naming the source and its file) for the first file source of `spec.data` that opening
    would refuse. Relative paths are under `base_dir` (default: the working directory)."""
    if spec.data is None:
        return
    for i, raw in enumerate(spec.data.sources):
        if raw.get("kind") not in FILE_SOURCE_KINDS:
            continue
        try:
            check_file_source(raw, base_dir)
        except SourceError as e:
            raise SourceError(f"data.sources.{i}.path: {_one_line(str(e))}") from None
        except (OSError, ValueError) as e:  # e.g. unreadable: say which source
            raise SourceError(f"data.sources.{i}.path: source {raw.get('name')!r}: {_one_line(str(e))}") from None


def check_file_source(raw: dict[str, Any], base_dir: str | Path | None = None) -> None:
    """SourceError if the file source `raw` cannot be opened and its first rows read."""
    s = parse_source_spec(raw)
    path = Path(s.path)
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path
    if not path.exists():
        raise SourceError(f"source {s.name!r}: {str(path)!r} does not exist (a {s.kind} "
                          f"{'directory' if s.kind == 'hf_disk' else 'file or directory'} was expected)")
    if s.kind == "jsonl":
        _check_jsonl(s.name, path, s.verifier, s.columns)
        return
    # Parquet metadata and an Arrow stream's schema are cheap to read: open the source as the run will, read block 0.
    from factory.data.sources.files import HFDiskSource, ParquetSource

    if s.kind == "parquet":
        if path.is_file() and not _has_parquet_magic(path):
            raise SourceError(f"source {s.name!r}: {str(path)!r} is not a Parquet file (no PAR1 magic bytes); "
                              f"kind: parquet expects a .parquet file or a directory of them")
        src: Any = ParquetSource(s.name, path, s.verifier, s.columns, block_rows=s.block_rows)
    else:
        src = HFDiskSource(s.name, path, s.verifier, s.columns, split=s.split, block_rows=s.block_rows)
    src.read_block(0)


def _has_parquet_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4:
            return False
        f.seek(-4, 2)
        return head == b"PAR1" and f.read(4) == b"PAR1"


def _check_jsonl(name: str, path: Path, verifier: str, columns: ColumnMap) -> None:
    from factory.data.sources.rows import check_verifier, problems_from_columns

    if path.is_dir():
        raise SourceError(f"source {name!r}: {str(path)!r} is a directory; kind: jsonl expects one file")
    check_verifier(name, verifier)
    line, number = b"", 0
    with open(path, "rb") as f:
        while not line.strip():
            line = f.readline(MAX_FIRST_LINE + 1)
            number += 1
            if not line:
                raise SourceError(f"source {name!r}: {str(path)!r} has no rows")
            if len(line) > MAX_FIRST_LINE:
                raise SourceError(f"source {name!r}: line {number} of {str(path)!r} is longer than "
                                  f"{MAX_FIRST_LINE >> 20} MiB: not a JSONL file of prompt rows")
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SourceError(f"source {name!r}: line {number} of {str(path)!r} is not JSON ({e}); kind: jsonl "
                          f"expects one JSON object per line") from None
    if not isinstance(row, dict):
        raise SourceError(f"source {name!r}: line {number} of {str(path)!r} is not a JSON object (got "
                          f"{type(row).__name__})")
    cm = columns.resolve(name, f"{str(path)!r} (line {number})", list(row))
    problems_from_columns({c: [row[c]] for c in cm.wanted()}, 1, cm, name, verifier, 0)
