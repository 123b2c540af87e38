"""Prompt sources: each kind reads its rows in blocks (in any block order, equal to a sequential read), carries
`source` and `verifier` in every row's meta, has a version that changes with its content, stays small in memory,
and refuses a bad source with an error naming it (and the file, column, table or snapshot)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.config import TaskSpec
from factory.data.sources import (
    ArithmeticSource,
    HFDiskSource,
    IcebergSource,
    JsonlSource,
    ParquetSource,
    SuiteSource,
    make_source,
)
from factory.data.sources.base import PromptSource, num_blocks
from factory.envs.arithmetic import arithmetic_capacity
from factory.envs.tasks import _SETS, _records, make_task_splits, verify
from factory.problem import Problem
from factory.source_spec import SourceError

REPO = Path(__file__).resolve().parents[2]


def all_rows(src: PromptSource) -> list:
    return [p for b in range(num_blocks(src)) for p in src.read_block(b)]


def shuffled_rows(src: PromptSource, seed: int = 0) -> list:
    """Blocks read in a random order, put back in source order: must equal a sequential read."""
    order = list(range(num_blocks(src)))
    random.Random(seed).shuffle(order)
    got = {b: src.read_block(b) for b in order}
    return [p for b in range(num_blocks(src)) for p in got[b]]


def check_meta(rows: list, name: str, verifier: str) -> None:
    assert rows and all(p.meta["source"] == name and p.meta["verifier"] == verifier for p in rows)


# ------------------------------------------------------------------ generated arithmetic levels

def test_arithmetic_level_is_distinct_exact_and_deterministic():
    src = ArithmeticSource("add3", "add", 3, n=5000, seed=7, block_rows=512)
    rows = all_rows(src)
    assert isinstance(src, PromptSource) and len(rows) == len(src) == 5000
    assert len({p.id for p in rows}) == 5000  # distinct problems, without a set of seen ids
    assert all(p.op == "add" and p.digits == 3 and verify(p.answer, p) == 1.0 for p in rows)
    a, b = rows[0].id.split("-")[1:]
    assert rows[0].answer == str(int(a) + int(b))[::-1]  # reverse_answer by default
    check_meta(rows, "add3", "arithmetic")
    again = ArithmeticSource("add3", "add", 3, n=5000, seed=7, block_rows=512)
    assert shuffled_rows(again, seed=3) == rows
    other_seed = ArithmeticSource("add3", "add", 3, n=5000, seed=8, block_rows=512)
    assert [p.id for p in all_rows(other_seed)] != [p.id for p in rows]
    assert other_seed.version() != src.version() == again.version()


def test_arithmetic_rows_are_pinned_to_their_version():
    """Rows depend only on the parameters in the version: changing how rows are drawn must change the version
    (its "format"), so this golden changes with it."""
    src = ArithmeticSource("add3", "add", 3, n=1000, seed=0)
    assert [p.id for p in src.read_block(0)[:4]] == ["add3-362-493", "add3-418-407", "add3-285-609", "add3-175-724"]
    assert src.version() == "6c94416e1778c88e"


def test_arithmetic_ranges_of_one_seed_are_disjoint():
    held_out = ArithmeticSource("mul2-eval", "mul", 2, n=300, seed=1)
    train = ArithmeticSource("mul2", "mul", 2, n=3000, seed=1, start=300)
    assert not {p.id for p in all_rows(held_out)} & {p.id for p in all_rows(train)}
    assert held_out.version() != train.version()


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_arithmetic_level_can_take_its_whole_space(op):
    space = arithmetic_capacity([op], [1])
    rows = all_rows(ArithmeticSource(f"{op}1", op, 1, n=space, block_rows=16))
    assert len({p.id for p in rows}) == space  # a bijection: every problem exactly once


def test_arithmetic_level_of_a_million_rows_holds_nothing():
    import tracemalloc

    tracemalloc.start()
    src = ArithmeticSource("add7", "add", 7, n=1_000_000, seed=0)
    last = src.read_block(num_blocks(src) - 1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(last) == 1_000_000 % 1024 and peak < 2 * 1024 * 1024


def test_arithmetic_level_refuses_more_rows_than_it_has():
    with pytest.raises(SourceError, match=r"source 'sub1'.*55 distinct sub problems"):
        ArithmeticSource("sub1", "sub", 1, n=50, start=10)
    with pytest.raises(SourceError, match="source 'x': op must be"):
        ArithmeticSource("x", "div", 2, n=10)


# ------------------------------------------------------------------ shipped suites

@pytest.mark.parametrize("suite", ["word_problems", "code"])
def test_suite_rows_are_the_task_familys_rows(suite):
    src = SuiteSource(suite, suite, block_rows=64)
    rows = shuffled_rows(src)
    file, make = _SETS[suite]
    assert [p.id for p in rows] == [r["id"] for r in _records(file)]
    check_meta(rows, suite, suite)
    task_rows = make_task_splits(TaskSpec(name=suite, n_train=len(src) - 8, n_eval=8), 0).train
    by_id = {p.id: p for p in rows}
    assert all(by_id[p.id].prompt == p.prompt and by_id[p.id].answer == p.answer and
               by_id[p.id].meta.get("tests") == p.meta.get("tests") for p in task_rows)
    data = (REPO / "factory" / "envs" / "suites" / f"{file}.jsonl").read_bytes()
    assert src.version() == hashlib.sha256(data).hexdigest()[:16]


def test_word_problem_rows_score_with_their_verifier():
    rows = SuiteSource("wp", "word_problems").read_block(0)
    assert all(verify(f"so \\boxed{{{p.answer}}}", p) == 1.0 and verify("0.5", p) == 0.0 for p in rows[:20])


# ------------------------------------------------------------------ JSONL

def write_jsonl(path: Path, records: list[dict], blank_every: int = 0) -> Path:
    lines = []
    for i, r in enumerate(records):
        lines.append(json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_maps_columns_and_reads_blocks_in_any_order(tmp_path):
    recs = [{"qid": f"q{i}", "question": f"{i}+1=", "gold": i + 1, "level": i % 3} for i in range(2500)]
    path = write_jsonl(tmp_path / "p.jsonl", recs, blank_every=7)
    src = JsonlSource("mine", path, "arithmetic",
                      {"id": "qid", "prompt": "question", "answer": "gold", "meta": ["level"]}, block_rows=100)
    rows = all_rows(src)
    assert len(src) == 2500 and [p.id for p in rows] == [r["qid"] for r in recs]
    assert rows[42].prompt == "42+1=" and rows[42].answer == "43" and rows[42].meta["level"] == 0
    check_meta(rows, "mine", "arithmetic")
    assert shuffled_rows(src) == rows
    assert src.version() == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    recs[5]["gold"] = 0
    write_jsonl(path, recs, blank_every=7)
    assert JsonlSource("mine", path, "arithmetic", src.columns, block_rows=100).version() != src.version()


def test_jsonl_columns_may_mix_types(tmp_path):
    recs = [{"prompt": "a", "answer": 7, "tests": ["x"]}, {"prompt": "b", "answer": "8", "tests": None},
            {"prompt": 3, "answer": 9.5, "tests": [1, "y"]}]
    rows = all_rows(JsonlSource("m", write_jsonl(tmp_path / "m.jsonl", recs), "code", {"meta": ["tests"]}))
    assert [(p.prompt, p.answer, p.meta["tests"]) for p in rows] == [("a", "7", ["x"]), ("b", "8", None),
                                                                     ("3", "9.5", [1, "y"])]
    assert {p.op for p in rows} == {"code"}


def test_jsonl_without_an_id_column_numbers_rows(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}", "answer": "a"} for i in range(10)])
    rows = all_rows(JsonlSource("n", path, "word_problems", block_rows=3))
    assert [p.id for p in rows] == [str(i) for i in range(10)] and {p.op for p in rows} == {"word"}
    with pytest.raises(SourceError, match="source 'n': .* has no column 'id'"):  # asked for by name: required
        JsonlSource("n", path, "word_problems", {"id": "id"})


def test_jsonl_errors_name_the_source_and_file(tmp_path):
    with pytest.raises(SourceError, match=r"source 'j': JSONL file '.*nope.jsonl' does not exist"):
        JsonlSource("j", tmp_path / "nope.jsonl", "arithmetic")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(SourceError, match=r"source 'j': '.*empty.jsonl' has no rows"):
        JsonlSource("j", tmp_path / "empty.jsonl", "arithmetic")
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(SourceError, match=r"source 'j': .*p.jsonl.* has no column 'prompt'; its columns are "
                                          r"'question', 'answer'"):
        JsonlSource("j", path, "arithmetic")
    # every line is checked when the source is opened; errors name the file's line (blank lines counted)
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": \n')
    with pytest.raises(SourceError, match=r"source 'j': line 3 of .*p.jsonl.* is not JSON"):
        JsonlSource("j", path, "arithmetic", block_rows=1)
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"}\n')
    src = JsonlSource("j", path, "arithmetic", block_rows=1)
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b" "answer": "2"}\n')  # changed after opening
    with pytest.raises(SourceError, match=r"source 'j': line 3 of .*p.jsonl.* is not JSON"):
        src.read_block(1)
    with pytest.raises(IndexError, match="source 'j': block 2 out of range"):
        src.read_block(2)


# ------------------------------------------------------------------ Parquet

def write_parquet(path: Path, n: int, row_group_size: int) -> Path:
    pq.write_table(pa.table({
        "uid": pa.array(range(n), pa.int64()),
        "text": [f"What is {i} plus {i + 1}? Answer with a number, nothing else." for i in range(n)],
        "label": [str(2 * i + 1) for i in range(n)],
        "unused": [b"x" * 64] * n,
    }), path, row_group_size=row_group_size)
    return path


def test_parquet_reads_mapped_columns_across_row_groups(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", 10_007, row_group_size=3000)
    src = ParquetSource("pq", path, "word_problems", {"id": "uid", "prompt": "text", "answer": "label"},
                        block_rows=700)  # blocks straddle row groups
    rows = all_rows(src)
    assert [p.id for p in rows] == [str(i) for i in range(10_007)]
    assert all(p.answer == str(2 * int(p.id) + 1) for p in rows) and "unused" not in rows[0].meta
    check_meta(rows, "pq", "word_problems")
    assert shuffled_rows(src, seed=1) == rows and shuffled_rows(src, seed=2) == rows
    assert src.version() == hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_parquet_directory_of_shards_is_one_source(tmp_path):
    table = pa.table({"prompt": [f"p{i}" for i in range(2600)], "answer": [str(i) for i in range(2600)]})
    (tmp_path / "ds" / "b").mkdir(parents=True)
    pq.write_table(table.slice(0, 1000), tmp_path / "ds" / "a.parquet", row_group_size=300)
    pq.write_table(table.slice(1000, 0), tmp_path / "ds" / "a2.parquet")  # an empty shard is skipped
    pq.write_table(table.slice(1000, 1600), tmp_path / "ds" / "b" / "c.parquet", row_group_size=700)
    (tmp_path / "ds" / "README.md").write_text("not data")
    src = ParquetSource("shards", tmp_path / "ds", "arithmetic", block_rows=256)
    rows = shuffled_rows(src)
    assert [p.prompt for p in rows] == [f"p{i}" for i in range(2600)] and rows[-1].id == "2599"
    assert src.version() == ParquetSource("shards", tmp_path / "ds", "arithmetic").version()
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "ds" / "b" / "d.parquet")
    with pytest.raises(SourceError, match=r"source 'shards': '.*d.parquet' has no column 'answer'; its columns are "
                                          r"'prompt'"):
        ParquetSource("shards", tmp_path / "ds", "arithmetic")
    (tmp_path / "none").mkdir()
    with pytest.raises(SourceError, match=r"source 'none': directory '.*none' holds no .parquet file"):
        ParquetSource("none", tmp_path / "none", "arithmetic")


def test_parquet_values_of_any_type_become_text(tmp_path):
    pq.write_table(pa.table({"id": pa.array([10, 11, 12], pa.int32()), "prompt": ["a", None, "c"],
                             "answer": pa.array([1.5, None, 3.0]), "level": pa.array([1, 2, 3], pa.int8()),
                             "tests": [["x"], [], None]}), tmp_path / "t.parquet")
    rows = all_rows(ParquetSource("t", tmp_path / "t.parquet", "code", {"meta": ["tests"], "digits": "level"}))
    assert [(p.id, p.prompt, p.answer, p.digits, p.meta["tests"]) for p in rows] == [
        ("10", "a", "1.5", 1, ["x"]), ("11", "", "", 2, []), ("12", "c", "3", 3, None)]
    plain = Problem("10", "a", "1.5", "code", 1, {"tests": ["x"], "source": "t", "verifier": "code"})
    assert rows[0] == plain and hash(rows[0]) == hash(plain) and rows[0].to_dict() == plain.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rows[0].id = "other"  # type: ignore[misc]


def test_parquet_errors_name_the_source_file_and_columns(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", 10, row_group_size=10)
    with pytest.raises(SourceError, match=r"source 'pq': .*p.parquet' has no column 'prompt', 'answer'; its "
                                          r"columns are 'uid', 'text', 'label', 'unused'"):
        ParquetSource("pq", path, "arithmetic")
    with pytest.raises(SourceError, match=r"source 'pq': Parquet file '.*missing.parquet' does not exist"):
        ParquetSource("pq", tmp_path / "missing.parquet", "arithmetic")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    with pytest.raises(SourceError, match=r"source 'pq': '.*empty.parquet' has no rows"):
        ParquetSource("pq", tmp_path / "empty.parquet", "arithmetic")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(SourceError, match=r"source 'pq': '.*bad.parquet' is not a readable Parquet file"):
        ParquetSource("pq", tmp_path / "bad.parquet", "arithmetic")


_MEMORY_PROBE = textwrap.dedent("""
    import json, sys, tracemalloc
    import pyarrow as pa
    from factory.data.sources.base import num_blocks
    from factory.data.sources import ParquetSource
    src = ParquetSource("big", sys.argv[1], "arithmetic", {"id": "uid", "prompt": "text", "answer": "label"})
    pool = pa.default_memory_pool()
    base = pool.bytes_allocated()
    tracemalloc.start()
    n = 0
    for b in range(num_blocks(src)):
        n += len(src.read_block(b))
    py_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps({"rows": n, "py_peak": py_peak, "arrow_peak": pool.max_memory() - base}))
""")


def memory_of_reading(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(path)], capture_output=True, text=True,
                         cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_parquet_of_200k_rows_streams_in_small_memory(tmp_path):
    """Read every block of a 200k-row file in a fresh process: the Python heap holds about one block of rows and
    Arrow about one row group, far below the file's decoded size, and the same as for a file half its size."""
    big = write_parquet(tmp_path / "big.parquet", 200_000, row_group_size=16_384)
    half = write_parquet(tmp_path / "half.parquet", 100_000, row_group_size=16_384)
    decoded = pq.read_table(big, columns=["uid", "text", "label"]).nbytes
    got, got_half = memory_of_reading(big), memory_of_reading(half)
    assert got["rows"] == 200_000 and got_half["rows"] == 100_000
    assert got["py_peak"] < 4 * 1024 * 1024, got  # one block of 1024 Problems is ~1 MB of Python objects
    assert got["arrow_peak"] < decoded / 4, (got, decoded)  # ~one row group's column chunks
    assert got["arrow_peak"] <= got_half["arrow_peak"] * 1.1 + 65536, (got, got_half)
    assert got["py_peak"] <= got_half["py_peak"] * 1.1 + 65536, (got, got_half)


# ------------------------------------------------------------------ Hugging Face save_to_disk

def write_hf_dataset(root: Path, table: pa.Table, files: int = 1, batch_rows: int = 1000) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: data-0000i-of-0000n.arrow (Arrow IPC streams),
    dataset_info.json (features) and state.json (the file list)."""
    root.mkdir(parents=True)
    per = -(-table.num_rows // files)
    names = []
    for i in range(files):
        name = f"data-{i:05d}-of-{files:05d}.arrow"
        with pa.ipc.new_stream(root / name, table.schema) as w:
            for b in table.slice(i * per, per).to_batches(max_chunksize=batch_rows):
                w.write_batch(b)
        names.append(name)
    features = {f.name: {"dtype": "string", "_type": "Value"} for f in table.schema}
    (root / "dataset_info.json").write_text(json.dumps({"features": features}))
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                 "_fingerprint": "0", "_format_type": None, "_split": None}))
    return root


def test_hf_save_to_disk_directory_reads_without_datasets(tmp_path):
    table = pa.table({"question": [f"q{i}" for i in range(2345)], "answer": [str(i) for i in range(2345)]})
    root = write_hf_dataset(tmp_path / "ds", table, files=3, batch_rows=333)
    src = HFDiskSource("hf", root, "word_problems", {"prompt": "question"}, block_rows=500)
    rows = all_rows(src)
    assert [p.prompt for p in rows] == [f"q{i}" for i in range(2345)] and rows[7].answer == "7"
    assert [p.id for p in rows] == [str(i) for i in range(2345)]
    check_meta(rows, "hf", "word_problems")
    assert shuffled_rows(src) == rows
    assert len(src.version()) == 16


@pytest.mark.slow
def test_hf_directory_written_by_datasets_itself(tmp_path):
    datasets = pytest.importorskip("datasets")
    n = 5000
    ds = datasets.Dataset.from_dict({"q": [f"q{i}" for i in range(n)], "a": list(range(n)),
                                     "tests": [[f"t{i}"] for i in range(n)]})
    ds.save_to_disk(str(tmp_path / "ds"), max_shard_size="50KB")  # several shards
    assert len(list((tmp_path / "ds").glob("data-*.arrow"))) > 1
    src = HFDiskSource("hf", tmp_path / "ds", "code", {"prompt": "q", "answer": "a", "meta": ["tests"]},
                       block_rows=700)
    rows = shuffled_rows(src)
    assert [(p.id, p.prompt, p.answer, p.meta["tests"]) for p in rows] == [
        (str(i), f"q{i}", str(i), [f"t{i}"]) for i in range(n)]
    datasets.DatasetDict({"train": ds, "test": ds.select(range(10))}).save_to_disk(str(tmp_path / "dd"))
    assert len(HFDiskSource("hf", tmp_path / "dd", "code", {"prompt": "q", "answer": "a"}, split="test")) == 10


def test_hf_dataset_dict_needs_a_split(tmp_path):
    table = pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]})
    write_hf_dataset(tmp_path / "dd" / "train", table)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert [p.prompt for p in all_rows(HFDiskSource("hf", tmp_path / "dd", "arithmetic", split="train"))] == ["a",
                                                                                                            "b"]
    with pytest.raises(SourceError, match=r"source 'hf': .* is a DatasetDict; set split to one of 'train'"):
        HFDiskSource("hf", tmp_path / "dd", "arithmetic")
    (tmp_path / "plain").mkdir()
    with pytest.raises(SourceError, match=r"source 'hf': '.*plain' has no state.json"):
        HFDiskSource("hf", tmp_path / "plain", "arithmetic")


# ------------------------------------------------------------------ Iceberg

def test_iceberg_source_is_pinned_to_its_snapshot(lake):
    cat = lake.catalog
    cat.create_namespace("prompts")
    tbl = cat.create_table("prompts.mix", schema=pa.schema([("prompt", pa.string()), ("answer", pa.string()),
                                                              ("level", pa.int64())]))
    for lo in (0, 600):
        tbl.append(pa.table({"prompt": [f"{i}+0=" for i in range(lo, lo + 600)],
                             "answer": [str(i)[::-1] for i in range(lo, lo + 600)],
                             "level": pa.array([i % 4 for i in range(lo, lo + 600)], pa.int64())}))
        if lo == 0:
            first = tbl.current_snapshot().snapshot_id
    src = IcebergSource("ice", cat, "prompts.mix", "arithmetic", snapshot_id=first,
                        columns={"meta": ["level"]}, block_rows=128)
    rows = all_rows(src)
    assert len(src) == 600 and src.version() == str(first)
    assert sorted(p.prompt for p in rows) == sorted(f"{i}+0=" for i in range(600))
    assert all(p.meta["level"] == int(p.prompt.split("+")[0]) % 4 for p in rows)
    check_meta(rows, "ice", "arithmetic")
    assert shuffled_rows(src) == rows
    latest = make_source({"name": "ice", "kind": "iceberg", "table": "prompts.mix", "verifier": "arithmetic"},
                         catalog=lake)
    assert len(latest) == 1200 and latest.version() == str(tbl.current_snapshot().snapshot_id) != src.version()
    tbl.delete("level = 0")  # a later snapshot without a quarter of the rows; the pinned source does not change
    after = IcebergSource("ice", cat, "prompts.mix", "arithmetic", columns={"meta": ["level"]})
    assert len(after) == 900 and all(p.meta["level"] != 0 for p in all_rows(after)) and len(src) == 600
    assert all_rows(src) == rows
    pinned = make_source({"name": "ice", "kind": "iceberg", "table": "prompts.mix", "verifier": "arithmetic",
                          "snapshot_id": first, "block_rows": 128})  # the lake of $FACTORY_HOME
    assert all_rows(pinned) == rows and pinned.version() == src.version()


def test_iceberg_errors_name_the_table_and_snapshot(lake):
    with pytest.raises(SourceError, match=r"source 'ice': Iceberg table 'prompts.none' does not exist"):
        IcebergSource("ice", lake.catalog, "prompts.none", "arithmetic")
    lake.catalog.create_namespace("prompts")
    tbl = lake.catalog.create_table("prompts.t", schema=pa.schema([("prompt", pa.string()), ("answer", pa.string())]))
    with pytest.raises(SourceError, match=r"source 'ice': Iceberg table 'prompts.t' has no snapshot"):
        IcebergSource("ice", lake.catalog, "prompts.t", "arithmetic")
    tbl.append(pa.table({"prompt": ["a"], "answer": ["1"]}))
    with pytest.raises(SourceError, match=r"source 'ice': Iceberg table 'prompts.t' has no snapshot 12345; its "
                                          r"latest are \[\d+\]"):
        IcebergSource("ice", lake.catalog, "prompts.t", "arithmetic", snapshot_id=12345)
    with pytest.raises(SourceError, match=r"no column 'text'; its columns are 'prompt', 'answer'"):
        IcebergSource("ice", lake.catalog, "prompts.t", "arithmetic", columns={"prompt": "text"})


# ------------------------------------------------------------------ verifiers and specs

def test_verifiers_are_checked_by_name(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    for ok in ("arithmetic", "word_problems", "code", "calculator_tool", "factory.envs.arithmetic:reward_fn"):
        assert JsonlSource("v", path, ok).read_block(0)[0].meta["verifier"] == ok
    with pytest.raises(SourceError, match="source 'v': unknown verifier 'arithmatic'"):
        JsonlSource("v", path, "arithmatic")
    for op in ("add", "word"):  # a built-in verifier's op is no scorer name: the environments would not score it
        with pytest.raises(SourceError, match=f"source 'v': unknown verifier '{op}'"):
            JsonlSource("v", path, op)
    with pytest.raises(SourceError, match=r"source 'v': verifier 'no_such_pkg.env:reward' does not load"):
        JsonlSource("v", path, "no_such_pkg.env:reward")
    with pytest.raises(SourceError, match="source 'a': unknown verifier 'nope'"):
        ArithmeticSource("a", "add", 2, n=10, verifier="nope")


def test_make_source_opens_every_kind_from_its_spec(tmp_path, lake):
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "answer": "1"}])
    write_parquet(tmp_path / "p.parquet", 50, row_group_size=20)
    write_hf_dataset(tmp_path / "hf", pa.table({"prompt": ["a"], "answer": ["1"]}))
    lake.catalog.create_namespace("prompts")
    lake.catalog.create_table("prompts.t", schema=pa.schema([("prompt", pa.string()), ("answer", pa.string())])
                              ).append(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}))
    specs = [
        {"name": "add2", "kind": "arithmetic", "op": "add", "digits": 2, "n": 100, "seed": 3},
        {"name": "wp", "kind": "suite", "suite": "word_problems"},
        {"name": "j", "kind": "jsonl", "path": "p.jsonl", "verifier": "arithmetic"},
        {"name": "p", "kind": "parquet", "path": str(tmp_path / "p.parquet"), "verifier": "arithmetic",
         "columns": {"id": "uid", "prompt": "text", "answer": "label"}, "block_rows": 16},
        {"name": "h", "kind": "hf_disk", "path": "hf", "verifier": "arithmetic"},
        {"name": "i", "kind": "iceberg", "table": "prompts.t", "verifier": "arithmetic"},
    ]
    sizes = {}
    for spec in specs:
        src = make_source(spec, base_dir=tmp_path, catalog=lake.catalog)
        assert isinstance(src, PromptSource) and src.name == spec["name"] and src.version()
        check_meta(all_rows(src), spec["name"], spec.get("verifier", spec.get("suite", "arithmetic")))
        sizes[spec["name"]] = len(src)
    assert sizes == {"add2": 100, "wp": 400, "j": 1, "p": 50, "h": 1, "i": 2}


def test_bad_specs_name_the_source_and_field():
    with pytest.raises(SourceError, match=r"source 'p': parquet.verifier: Field required"):
        make_source({"name": "p", "kind": "parquet", "path": "x.parquet"})
    with pytest.raises(SourceError, match=r"source 'q': .*'arithmetic', 'suite', 'jsonl'"):
        make_source({"name": "q", "kind": "csv"})
    with pytest.raises(SourceError, match=r"source 'a': arithmetic.digits: Input should be less than or equal"):
        make_source({"name": "a", "kind": "arithmetic", "op": "add", "digits": 40, "n": 5})
    with pytest.raises(SourceError, match=r"source 'j': jsonl.columns.question: Extra inputs"):
        make_source({"name": "j", "kind": "jsonl", "path": "x", "verifier": "code", "columns": {"question": "q"}})
