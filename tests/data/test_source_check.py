"""`check_sources`: what opening a spec's file sources or reading any of their rows would refuse, found before the
run: every row (a JSONL line broken far into the file, a line past the size limit, read without being held), and
paths that are not regular files (a FIFO, a device), refused without opening them; a spec built in Python keeps
relative paths, read against the working directory."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import tracemalloc
from collections.abc import Iterator
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


STUCK_S = 60.0  # only turns a hang into a failure


def jsonl_spec(path: Path, kind: str = "jsonl") -> object:
    return parse_spec({"data": {"sources": [{"name": "j", "kind": kind, "path": str(path), "verifier": "arithmetic"}]}})


def rows(n: int) -> list[str]:
    return [json.dumps({"id": f"q{i}", "prompt": f"{i % 10}+{i % 7}=", "answer": str(i % 10 + i % 7)})
            for i in range(n)]


def test_a_row_broken_far_into_the_file_is_refused_naming_its_line(tmp_path):
    lines = rows(100)
    lines[50] = '{"id": "q50", "prompt": broken'  # line 51: the run met it after SFT, as "row 50"
    path = tmp_path / "bad51.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SourceError) as e:
        check_sources(jsonl_spec(path))
    assert str(e.value).startswith(f"data.sources.0.path: source 'j': line 51 of '{path}' is not JSON")
    lines[50] = json.dumps({"id": "q50", "question": "1+1="})  # a row without the mapped columns
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SourceError, match=r"line 51 of .* has no column 'prompt', 'answer'"):
        check_sources(jsonl_spec(path))


def test_an_oversized_line_anywhere_is_refused_without_holding_it(tmp_path):
    lines = rows(40)
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        f.write("\n".join(lines[:20]) + "\n")
        f.write('{"id": "q20", "prompt": "' + "7" * (48 << 20) + '", "answer": "1"}\n')  # line 21: 48 MiB
        f.write("\n".join(lines[21:]) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(SourceError) as e:
            check_sources(jsonl_spec(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "line 21 of" in str(e.value) and "longer than 16 MiB" in str(e.value)
    assert peak < 40 << 20  # at most one limit's worth of the line was read into memory


@contextlib.contextmanager
def fifo(path: Path) -> Iterator[Path]:
    """A FIFO at `path`. A helper opens its write end and closes it at once, which only completes when some reader
    opens it: a check that reads the FIFO then sees an empty file instead of hanging, and the test ends either way."""
    os.mkfifo(path)
    writer = threading.Thread(target=lambda: os.close(os.open(path, os.O_WRONLY)), daemon=True)
    writer.start()
    try:
        yield path
    finally:
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer's open complete if nobody read
        writer.join(STUCK_S)
        os.close(reader)
        assert not writer.is_alive()


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_fifo_is_refused_without_being_opened(tmp_path, kind):
    with fifo(tmp_path / f"rows.{kind}") as path:
        with pytest.raises(SourceError) as e:
            check_sources(jsonl_spec(path, kind))
    assert f"'{path}' is a FIFO (named pipe), not a regular file" in str(e.value)


def test_a_fifo_among_parquet_shards_and_a_device_are_refused(tmp_path):
    write_parquet(tmp_path / "shards" / "a.parquet", GOOD)
    with fifo(tmp_path / "shards" / "b.parquet") as path:
        with pytest.raises(SourceError, match=r"shards/b.parquet' is a FIFO \(named pipe\)"):
            check_sources(jsonl_spec(path.parent, "parquet"))
    with pytest.raises(SourceError, match=r"'/dev/zero' is a character device, not a regular file"):
        check_sources(jsonl_spec(Path("/dev/zero")))


def test_a_prompt_too_long_for_a_preset_model_is_refused_naming_its_line(tmp_path):
    """A preset's character tokenizer gives one token per character after <bos>: a row whose prompt cannot fit the
    model's positions (64 for tiny, 8 of them for the completion) is found before the run, not by the run's
    tokenizer (which took 2 minutes on a 16 MiB prompt before refusing it)."""
    lines = rows(40)
    lines[20] = json.dumps({"id": "q20", "prompt": "1+" * 50 + "1=", "answer": "51"})  # line 21: 102 characters
    path = tmp_path / "long.jsonl"
    path.write_text("\n\n" + "\n".join(lines) + "\n")  # two blank lines first: line 23 of the file
    with pytest.raises(SourceError) as e:
        check_sources(jsonl_spec(path))
    assert f"line 23 of '{path}': its prompt has 102 characters, at most 55 fit" in str(e.value)
    model_path = parse_spec({"model": {"path": str(tmp_path)}, "data": {"sources": [
        {"name": "j", "kind": "jsonl", "path": str(path), "verifier": "arithmetic"}]}})
    check_sources(model_path)  # a model.path model's tokenizer decides when it loads
