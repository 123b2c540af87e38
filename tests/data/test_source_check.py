"""`check_sources`: what opening a spec's file sources would refuse, found without opening them for the run; a
spec built in Python keeps relative paths, read against the working directory."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.config import parse_spec
from factory.data.source_check import check_sources
from factory.source_spec import SourceError

GOOD = {"id": ["q0", "q1"], "prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def test_python_specs_resolve_relative_paths_against_the_working_directory(tmp_path, monkeypatch):
    write_parquet(tmp_path / "rows.parquet", GOOD)
    spec = parse_spec({"data": {"sources": [{"name": "f", "kind": "parquet", "path": "rows.parquet",
                                             "verifier": "arithmetic"}]}})
    assert spec.data.sources[0]["path"] == "rows.parquet"  # kept as given
    monkeypatch.chdir(tmp_path)
    check_sources(spec)
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(SourceError, match=r"data.sources.0.path: .*does not exist"):
        check_sources(spec)
    check_sources(spec, base_dir=tmp_path)


def test_good_sources_pass(tmp_path):
    pq_path = write_parquet(tmp_path / "shards" / "a.parquet", GOOD)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text('\n{"id": "a", "prompt": "1+1=", "answer": "2"}\n{"id": "b", "prompt": "2+2=", "answer": 4}\n')
    spec = parse_spec({"data": {"sources": [
        {"name": "p", "kind": "parquet", "path": str(pq_path), "verifier": "arithmetic"},
        {"name": "d", "kind": "parquet", "path": str(pq_path.parent), "verifier": "arithmetic"},
        {"name": "j", "kind": "jsonl", "path": str(jsonl), "verifier": "arithmetic"}]}})
    check_sources(spec)


@pytest.mark.parametrize(("name", "body", "words"), [
    ("empty.jsonl", b"\n\n", "has no rows"),
    ("list.jsonl", b"[1, 2]\n", "not a JSON object"),
    ("binary.jsonl", bytes(range(256)) * 4, "not JSON"),
    ("cols.jsonl", b'{"question": "1+1=", "answer": "2"}\n', "'prompt'; its columns are 'question'"),
])
def test_bad_jsonl_is_refused_naming_the_source(tmp_path, name, body, words):
    (tmp_path / name).write_bytes(body)
    spec = parse_spec({"data": {"sources": [{"name": "j", "kind": "jsonl", "path": str(tmp_path / name),
                                             "verifier": "arithmetic"}]}})
    with pytest.raises(SourceError) as e:
        check_sources(spec)
    line = str(e.value)
    assert line.startswith("data.sources.0.path: source 'j'") and words in line and "\n" not in line, line
