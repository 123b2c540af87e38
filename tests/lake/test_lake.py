"""The lake's tables and writer: keyed idempotent upserts, validation, nulls, time zones, upkeep,
and no lost rows when two processes write the same table at once."""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import random

import pyarrow as pa
import pytest

import factory.lake.writer as writer
from factory.home import FactoryPaths
from factory.home import factory_home as open_home
from factory.infra.supervisor import retry
from factory.lake import TABLES, Lake, ensure_tables, open_catalog

T0 = dt.datetime(2025, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)


def step_row(run_id: str, step: int, loss: float = 1.0, **extra) -> dict:
    return dict(run_id=run_id, step=step, weight_version=step, loss=loss, recorded_at=T0, **extra)


def by_key(tbl: pa.Table, *key: str) -> dict:
    return {tuple(r[k] for k in key): r for r in tbl.to_pylist()}


def test_tables_created_once_with_keys_as_identifier_fields(factory_home: FactoryPaths):
    catalog = open_catalog(factory_home)
    first = ensure_tables(catalog)
    again = ensure_tables(open_catalog(factory_home))  # a second process opening the same home
    assert sorted(first) == sorted(again) == sorted(TABLES)
    assert {t[1] for t in catalog.list_tables("factory")} == set(TABLES)
    for name, tdef in TABLES.items():
        schema = again[name].schema()
        assert set(schema.identifier_field_names()) == set(tdef.key)
        assert [f.name for f in schema.fields] == list(tdef.columns)
        assert again[name].metadata.table_uuid == first[name].metadata.table_uuid


@pytest.mark.slow
def test_upsert_same_key_twice_leaves_one_row_with_latest_values(lake: Lake):
    lake.upsert("steps", [step_row("r1", 6, loss=0.6), step_row("r1", 7, loss=0.7)])
    lake.upsert("steps", [step_row("r1", 7, loss=0.07, kl=0.5)])
    lake.upsert("steps", [step_row("r1", 7, loss=0.07, kl=0.5)])  # a resumed run writes it again
    rows = by_key(lake.read("steps"), "run_id", "step")
    assert sorted(rows) == [("r1", 6), ("r1", 7)]
    assert rows[("r1", 7)]["loss"] == 0.07 and rows[("r1", 7)]["kl"] == 0.5
    assert rows[("r1", 6)]["loss"] == 0.6 and rows[("r1", 6)]["kl"] is None


@pytest.mark.slow
def test_batch_with_duplicate_keys_keeps_the_last(lake: Lake):
    n = lake.upsert("steps", [step_row("r1", 1, loss=1.0), step_row("r1", 2, loss=2.0),
                              step_row("r1", 1, loss=9.0)])
    assert n == 2
    rows = by_key(lake.read("steps"), "run_id", "step")
    assert len(rows) == 2 and rows[("r1", 1)]["loss"] == 9.0


@pytest.mark.slow
def test_upsert_rewrites_only_matching_keys_of_a_composite_key(lake: Lake):
    base = dict(run_id="r1", step=10, n=100, recorded_at=T0)
    lake.upsert("evals", [dict(base, benchmark="b1", metric="accuracy", value=0.5),
                          dict(base, benchmark="b1", metric="pass_at_8", value=0.8),
                          dict(base, benchmark="b2", metric="accuracy", value=0.3),
                          dict(base, run_id="r2", benchmark="b1", metric="accuracy", value=0.1)])
    lake.upsert("evals", [dict(base, benchmark="b1", metric="accuracy", value=0.55)])
    rows = by_key(lake.read("evals"), "run_id", "benchmark", "metric")
    assert {k: r["value"] for k, r in rows.items()} == {
        ("r1", "b1", "accuracy"): 0.55, ("r1", "b1", "pass_at_8"): 0.8,
        ("r1", "b2", "accuracy"): 0.3, ("r2", "b1", "accuracy"): 0.1,
    }


@pytest.mark.slow
def test_timestamp_in_key_node_health(lake: Lake):
    later = T0 + dt.timedelta(seconds=1)
    check = dict(node="n1", check="gpu_mem", expected=">= 70GiB")
    lake.upsert("node_health", [dict(check, value=78.0, passed=True, recorded_at=T0),
                                dict(check, value=1.0, passed=False, recorded_at=later)])
    lake.upsert("node_health", [dict(check, value=77.0, passed=True, recorded_at=T0)])
    rows = by_key(lake.read("node_health"), "recorded_at")
    assert set(rows) == {(T0,), (later,)}
    assert rows[(T0,)]["value"] == 77.0 and rows[(later,)]["passed"] is False


def test_missing_required_column_is_named(lake: Lake):
    row = step_row("r1", 1)
    del row["weight_version"]
    with pytest.raises(ValueError, match=r"steps: missing required column 'weight_version'"):
        lake.upsert("steps", [row])
    with pytest.raises(ValueError, match=r"steps: missing required column 'run_id'"):
        lake.upsert("steps", [dict(step_row("r1", 1), run_id=None)])
    assert lake.read("steps").num_rows == 0


def test_unknown_column_table_and_bad_type_are_named(lake: Lake):
    with pytest.raises(ValueError, match=r"steps: unknown column 'los'"):
        lake.upsert("steps", [dict(step_row("r1", 1), los=1.0)])
    with pytest.raises(ValueError, match=r"unknown lake table 'step'"):
        lake.upsert("step", [step_row("r1", 1)])
    with pytest.raises(ValueError, match=r"steps.step in row 0: expected an integer"):
        lake.upsert("steps", [step_row("r1", 1.5)])
    with pytest.raises(ValueError, match=r"steps.loss in row 0: expected float, got str"):
        lake.upsert("steps", [step_row("r1", 1, loss="low")])


@pytest.mark.slow
def test_optional_columns_missing_from_the_dict_are_null(lake: Lake):
    lake.upsert("runs", [dict(run_id="r1", name="n", spec={"model": "micro"}, spec_fingerprint="f",
                              code_version="abc", status="running", seed=1, started_at=T0)])
    run = lake.read("runs").to_pylist()[0]
    for col in ("sweep_id", "mlflow_run_id", "init_checkpoint", "final_checkpoint", "ended_at"):
        assert run[col] is None, col
    assert run["spec"] == '{"model": "micro"}'  # dicts are stored as JSON text
    lake.upsert("steps", [dict(run_id="r1", step=0, weight_version=0, recorded_at=T0)])
    step = lake.read("steps").to_pylist()[0]
    assert all(step[m] is None for m in ("loss", "reward_mean", "kl", "tokens_per_s", "wall_s"))


@pytest.mark.slow
def test_timestamps_are_stored_in_utc(lake: Lake):
    plus2 = dt.timezone(dt.timedelta(hours=2))
    at_naive = dt.datetime(2025, 1, 2, 3, 4, 5)
    rows = [step_row("r1", 1) | {"recorded_at": T0.astimezone(plus2)},
            step_row("r1", 2) | {"recorded_at": at_naive},
            step_row("r1", 3) | {"recorded_at": "2025-01-02T05:04:05.678901+02:00"}]
    lake.upsert("steps", rows)
    got = by_key(lake.read("steps"), "step")
    assert lake.read("steps").schema.field("recorded_at").type == pa.timestamp("us", tz="UTC")
    assert got[(1,)]["recorded_at"] == T0 and got[(3,)]["recorded_at"] == T0
    assert got[(2,)]["recorded_at"] == at_naive.replace(tzinfo=dt.UTC)  # naive datetimes are taken as UTC


@pytest.mark.slow
def test_read_with_row_filter(lake: Lake):
    lake.upsert("steps", [step_row("r1", s) for s in range(5)] + [step_row("r2", 0)])
    assert sorted(lake.read("steps", "run_id == 'r1' and step >= 3")["step"].to_pylist()) == [3, 4]


@pytest.mark.slow
def test_upkeep_compacts_small_files_and_keeps_every_row(lake: Lake, monkeypatch):
    monkeypatch.setattr(writer, "COMPACT_AFTER_FILES", 4)
    monkeypatch.setattr(writer, "KEEP_SNAPSHOTS", 2)
    monkeypatch.setattr(writer, "EXPIRE_MIN_AGE_S", 0.0)
    for s in range(12):
        lake.upsert("steps", [step_row("r1", s, loss=float(s))])
    lake.upsert("steps", [step_row("r1", 3, loss=-3.0)])  # rewrite a key that now sits in a merged file
    tbl = lake.table("steps")
    n_files = int(tbl.current_snapshot().summary["total-data-files"])
    assert n_files < 5, n_files
    assert len(tbl.metadata.snapshots) <= 3 * 2 + 1
    rows = by_key(lake.read("steps"), "step")
    assert sorted(rows) == [(s,) for s in range(12)]
    assert rows[(3,)]["loss"] == -3.0 and rows[(11,)]["loss"] == 11.0


@pytest.mark.slow
def test_large_batch_with_many_key_groups(lake: Lake):
    # 3000 distinct (run_id, step, prompt_id) groups: the key filter must not recurse 3000 deep.
    rows = [dict(run_id="r1", step=s, prompt_id=f"p{p}", sample=0, prompt="1+1=", completion="2", reward=1.0,
                 weight_version=s, staleness=0, latency_s=0.01, recorded_at=T0) for s in range(30) for p in range(100)]
    assert lake.upsert("rollouts", rows) == 3000
    assert lake.upsert("rollouts", rows[:10]) == 10
    assert lake.read("rollouts").num_rows == 3000


def _write_steps(home: str, run_id: str, n: int, barrier, compact_after: int) -> None:
    writer.COMPACT_AFTER_FILES = compact_after  # force compactions to race with the other writer
    lake = Lake.open(open_home(home))
    barrier.wait()  # start together so commits actually conflict
    for s in range(n):
        lake.upsert("steps", [step_row(run_id, s, loss=float(s))])
        if s % 5 == 4:  # and rewrite an older key, which may sit in a file compacted meanwhile
            lake.upsert("steps", [step_row(run_id, s - 3, loss=-1.0)])
    lake.close()


@pytest.mark.slow
def test_two_processes_writing_one_table_lose_no_rows(lake: Lake, factory_home: FactoryPaths):
    ctx = mp.get_context("spawn")  # no SQLite handles inherited through fork
    barrier = ctx.Barrier(2)
    n = 15
    procs = [ctx.Process(target=_write_steps, args=(str(factory_home.root), f"p{i}", n, barrier, 6))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    rows = by_key(lake.read("steps"), "run_id", "step")
    assert len(rows) == 2 * n
    assert sorted(rows) == sorted((f"p{i}", s) for i in range(2) for s in range(n))
    rewritten = {1, 6, 11}
    for (run_id, s), row in rows.items():
        assert row["loss"] == (-1.0 if s in rewritten else float(s)), (run_id, s)


def test_a_conflicted_write_waits_what_its_hand_written_loop_waited():
    """After failed attempt n: uniform in [0, min(0.5, 0.01 * 2**n)] s, the same draws from `random`."""
    slept, calls = [], []

    def conflicting() -> None:
        calls.append(1)
        raise writer.CommitFailedException("lost a race")

    random.seed(7)
    with pytest.raises(writer.CommitFailedException, match="lost a race"):
        retry(conflicting, attempts=writer.UPSERT_ATTEMPTS, on=writer.CONFLICTS, wait=writer.CONFLICT_WAIT,
              sleep=slept.append)
    random.seed(7)
    assert len(calls) == writer.UPSERT_ATTEMPTS
    assert slept == [random.uniform(0, min(0.5, 0.01 * 2**n)) for n in range(1, writer.UPSERT_ATTEMPTS)]
