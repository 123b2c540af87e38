"""Partitioning and schema evolution: new tables get their partition spec; a lake written by an older
Factory (unpartitioned tables, fewer columns) is brought up to date on open without rewriting data,
and its old rows stay readable and upsertable beside the new ones."""

from __future__ import annotations

import datetime as dt

import pytest
from pyiceberg.catalog import Catalog
from pyiceberg.partitioning import UNPARTITIONED_PARTITION_SPEC
from pyiceberg.transforms import BucketTransform

import factory.lake.writer as writer
from factory.home import FactoryPaths
from factory.lake import TABLES, Lake, open_catalog, query
from factory.lake.catalog import TABLE_PROPERTIES, _ensure_table
from factory.lake.schemas import GAP_COLUMNS, SOURCE_GAP_COLUMNS, STEP_SOURCES, STEPS, PartitionBy, TableDef, _table
from factory.lake.writer import to_arrow

T0 = dt.datetime(2025, 2, 3, 4, 5, 6, tzinfo=dt.UTC)
NEW_COLUMN = STEPS.columns[-1]  # the last column the steps table gained


def step_row(run_id: str, step: int, **extra) -> dict:
    return dict(run_id=run_id, step=step, weight_version=step, loss=float(step), recorded_at=T0, **extra)


def older(tdef: TableDef, drop_last: int = 1) -> TableDef:
    """`tdef` as an older Factory defined it: without its last columns and unpartitioned."""
    cols = [(f.name, f.field_type, f.required) for f in tdef.schema.fields[:-drop_last]]
    return _table(tdef.name, tdef.key, cols)


def create_old_table(catalog: Catalog, tdef: TableDef) -> None:
    catalog.create_namespace_if_not_exists("factory")
    catalog.create_table(tdef.identifier, schema=tdef.schema, partition_spec=UNPARTITIONED_PARTITION_SPEC,
                         properties={"format-version": "2", **TABLE_PROPERTIES})


def spec_of(lake: Lake, name: str) -> list[tuple[str, str]]:
    tbl = lake.table(name)
    return [(tbl.schema().find_column_name(f.source_id), str(f.transform)) for f in tbl.spec().fields]


def data_files(lake: Lake, name: str) -> dict[str, int]:
    """path -> spec id of every live data file."""
    return {t.file.file_path: t.file.spec_id for t in lake.table(name).scan().plan_files()}


def data_files_of(catalog: Catalog, tdef: TableDef) -> list[str]:
    return [t.file.file_path for t in catalog.load_table(tdef.identifier).scan().plan_files()]


def test_new_tables_are_created_partitioned(lake: Lake):
    assert spec_of(lake, "steps") == spec_of(lake, "rollouts") == spec_of(lake, "evals") == [("run_id", "bucket[16]")]
    assert spec_of(lake, "node_health") == [("recorded_at", "day")]
    assert spec_of(lake, "runs") == spec_of(lake, "checkpoints") == spec_of(lake, "sweeps") == []
    # Two runs in different buckets land in different files, each under its bucket's directory.
    bucket = BucketTransform(16).transform(TABLES["steps"].schema.find_field("run_id").field_type)
    a, b = next((a, b) for a in ("r0", "r1", "r2") for b in ("r3", "r4", "r5") if bucket(a) != bucket(b))
    lake.upsert("steps", [step_row(a, 0), step_row(b, 0)])
    paths = sorted(data_files(lake, "steps"))
    assert len(paths) == 2
    assert {f"run_id_bucket_16={bucket(a)}", f"run_id_bucket_16={bucket(b)}"} <= {
        part for p in paths for part in p.split("/")}


def test_day_partitioned_node_health_round_trip(lake: Lake):
    rows = [dict(node="n1", check="gpu_mem", value=1.0, passed=True, recorded_at=T0 + dt.timedelta(days=d))
            for d in range(3)]
    lake.upsert("node_health", rows)
    lake.upsert("node_health", [dict(rows[1], value=2.0)])  # keyed rewrite inside one day's partition
    got = {r["recorded_at"]: r["value"] for r in lake.read("node_health").to_pylist()}
    assert got == {T0: 1.0, T0 + dt.timedelta(days=1): 2.0, T0 + dt.timedelta(days=2): 1.0}
    assert len(data_files(lake, "node_health")) == 3


@pytest.mark.slow
def test_old_lake_gains_partitioning_and_columns_without_rewriting(factory_home: FactoryPaths, monkeypatch):
    old = older(STEPS)
    assert NEW_COLUMN not in old.columns
    catalog = open_catalog(factory_home)
    create_old_table(catalog, old)
    catalog.load_table(old.identifier).append(to_arrow(old, [step_row("r1", s) for s in range(3)]))
    old_files = set(data_files_of(catalog, old))

    with Lake.open(factory_home) as lake:
        tbl = lake.table("steps")
        # The schema: the new column appended with the field id the definition gives it.
        assert [(f.name, f.field_id) for f in tbl.schema().fields] == [
            (f.name, f.field_id) for f in STEPS.schema.fields]
        assert not tbl.schema().find_field(NEW_COLUMN).required
        # The spec evolved, and the old file is still there, untouched, under the old spec.
        assert spec_of(lake, "steps") == [("run_id", "bucket[16]")]
        assert data_files(lake, "steps") == dict.fromkeys(old_files, 0)

        old_rows = {r["step"]: r for r in lake.read("steps").to_pylist()}
        assert sorted(old_rows) == [0, 1, 2] and all(r[NEW_COLUMN] is None for r in old_rows.values())

        # New rows get the column and a partitioned file; a key living in the old file is replaced.
        lake.upsert("steps", [step_row("r1", 3, **{NEW_COLUMN: 4.0}), step_row("r1", 1, **{NEW_COLUMN: 2.0})])
        rows = {r["step"]: r for r in lake.read("steps").to_pylist()}
        assert sorted(rows) == [0, 1, 2, 3]
        assert {s: r[NEW_COLUMN] for s, r in rows.items()} == {0: None, 1: 2.0, 2: None, 3: 4.0}
        assert 1 in set(data_files(lake, "steps").values())  # files written under the new spec

        # DuckDB sees both generations of rows.
        got = query(f"SELECT step, {NEW_COLUMN} FROM steps ORDER BY step", lake).to_pylist()
        assert got == [{"step": 0, NEW_COLUMN: None}, {"step": 1, NEW_COLUMN: 2.0},
                       {"step": 2, NEW_COLUMN: None}, {"step": 3, NEW_COLUMN: 4.0}]

        # Compaction merges files of both specs into partitioned ones and keeps every row.
        monkeypatch.setattr(writer, "SMALL_FILE_BYTES", 1 << 30)
        assert lake.maintain("steps")
        assert set(data_files(lake, "steps").values()) == {1}
        assert lake.read("steps").sort_by("step").to_pylist() == sorted(rows.values(), key=lambda r: r["step"])

    with Lake.open(factory_home) as lake:  # opening again changes nothing
        assert len(lake.table("steps").metadata.partition_specs) == 2


def test_a_lake_from_before_the_gap_columns_takes_them_and_keeps_its_rows(factory_home: FactoryPaths):
    """`steps` and `step_sources` as they were before the sampler/trainer gap was recorded, with rows: opening the lake
    appends the gap columns with the field ids the definitions give them; the old rows read NULL there (never 0),
    and a step recorded now keeps its figures beside them, in pyiceberg and in DuckDB."""
    assert STEPS.columns[-len(GAP_COLUMNS):] == GAP_COLUMNS
    assert STEP_SOURCES.columns[-len(SOURCE_GAP_COLUMNS):] == SOURCE_GAP_COLUMNS
    old_steps, old_sources = older(STEPS, len(GAP_COLUMNS)), older(STEP_SOURCES, len(SOURCE_GAP_COLUMNS))
    assert old_steps.columns[-1] == "response_tokens_mean" and old_sources.columns[-1] == "recorded_at"
    catalog = open_catalog(factory_home)
    for tdef in (old_steps, old_sources):
        create_old_table(catalog, tdef)
    catalog.load_table(old_steps.identifier).append(to_arrow(old_steps, [
        step_row("r1", s, response_tokens_mean=7.0) for s in (1, 2)]))
    source_row = dict(run_id="r1", source="arith", groups=2, recorded_at=T0)
    catalog.load_table(old_sources.identifier).append(to_arrow(old_sources, [dict(source_row, step=1)]))

    gap = dict(zip(GAP_COLUMNS, (0.01, 0.2, 5e-5, 0.002, 0.3, 1.0, 0.04, 0.99, 0.001, 0.0), strict=True))
    with Lake.open(factory_home) as lake:
        for tdef in (STEPS, STEP_SOURCES):
            assert [(f.name, f.field_id, f.required) for f in lake.table(tdef.name).schema().fields] == [
                (f.name, f.field_id, False if f.name in GAP_COLUMNS else f.required) for f in tdef.schema.fields]
        lake.upsert("steps", [step_row("r1", 3, response_tokens_mean=8.0, **gap)])
        lake.upsert("step_sources", [dict(source_row, step=2, gap_abs_mean=0.02, gap_kl=1e-4)])
        rows = {r["step"]: r for r in lake.read("steps").to_pylist()}
        assert sorted(rows) == [1, 2, 3] and [rows[s]["response_tokens_mean"] for s in (1, 2, 3)] == [7.0, 7.0, 8.0]
        assert [rows[s][c] for s in (1, 2) for c in GAP_COLUMNS] == [None] * 2 * len(GAP_COLUMNS)
        assert {c: rows[3][c] for c in GAP_COLUMNS} == gap
        got = query("SELECT step, gap_abs_mean, gap_kl FROM step_sources ORDER BY step", lake).to_pylist()
        assert got == [{"step": 1, "gap_abs_mean": None, "gap_kl": None}, {"step": 2, "gap_abs_mean": 0.02,
                                                                           "gap_kl": 1e-4}]
        got = query("SELECT step, gap_kl, correction_masked_tokens FROM steps ORDER BY step", lake).to_pylist()
        assert got == [{"step": 1, "gap_kl": None, "correction_masked_tokens": None},
                       {"step": 2, "gap_kl": None, "correction_masked_tokens": None},
                       {"step": 3, "gap_kl": 5e-5, "correction_masked_tokens": 0.001}]


def test_adding_a_required_column_is_refused_by_name(factory_home: FactoryPaths):
    catalog = open_catalog(factory_home)
    create_old_table(catalog, older(STEPS))
    cols = [(f.name, f.field_type, f.required) for f in STEPS.schema.fields]
    cols[-1] = (cols[-1][0], cols[-1][1], True)
    with pytest.raises(ValueError, match=rf"steps: cannot add required column\(s\) \['{NEW_COLUMN}'\]"):
        _ensure_table(catalog, _table("steps", STEPS.key, cols))


def test_a_column_inserted_mid_definition_is_refused(factory_home: FactoryPaths):
    catalog = open_catalog(factory_home)
    create_old_table(catalog, older(STEPS))
    # A column inserted before the end shifts the definition's field ids away from the table's.
    cols = [(f.name, f.field_type, f.required) for f in STEPS.schema.fields]
    cols.insert(3, cols.pop())
    with pytest.raises(ValueError, match=r"steps: column '\w+' has field id \d+ in the catalog, expected \d+"):
        _ensure_table(catalog, _table("steps", STEPS.key, cols, STEPS.partition))


def test_changed_bucket_count_evolves_the_spec(factory_home: FactoryPaths):
    catalog = open_catalog(factory_home)
    with Lake.open(factory_home):
        pass
    eight = TableDef(STEPS.name, STEPS.schema, STEPS.key, (PartitionBy("run_id", BucketTransform(8)),))
    tbl = _ensure_table(catalog, eight)
    assert [(f.name, str(f.transform)) for f in tbl.spec().fields] == [("run_id_bucket_8", "bucket[8]")]
