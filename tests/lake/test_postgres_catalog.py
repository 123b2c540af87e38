"""The Iceberg catalog on a real PostgreSQL server (pyiceberg's SqlCatalog with a Postgres URI, chosen by
$FACTORY_CATALOG_URI): concurrent writer processes lose no commit, `factory runs` / `factory query` read it, and a
server restart (every connection cut, through tests/tcp_proxy.py) neither fails the first read after it nor, while it
lasts, the report a finished run reads."""

from __future__ import annotations

import json
import multiprocessing as mp
from datetime import UTC, datetime

from sqlalchemy.engine import make_url

from factory.cli import main
from factory.envs.eval_suites import HELD_OUT
from factory.home import factory_home
from factory.lake import Lake, query
from factory.runs.experiment import report_when_up
from tests.tcp_proxy import TcpProxy

WRITERS, COMMITS = 16, 3


def _step_row(run_id: str, step: int) -> dict:
    return {"run_id": run_id, "step": step, "weight_version": step, "loss": 0.5, "reward_mean": step / 10,
            "reward_std": 0.1, "accuracy": 0.5, "kl": 0.0, "entropy": 1.0, "clip_frac": 0.0, "grad_norm": 1.0,
            "logprob_mismatch": 0.0, "staleness_mean": 0.0, "staleness_max": 0.0, "tokens_per_s": 100.0,
            "trainer_idle_fraction": 0.0, "wall_s": 1.0, "recorded_at": datetime.now(UTC)}


def _writer(home: str, uri: str, i: int, start: mp.Event) -> None:
    lake = Lake.open(factory_home(home), uri=uri, auto_maintain=False)
    start.wait(60)
    for step in range(1, COMMITS + 1):  # one commit each: 16 processes race on the same table
        lake.upsert("steps", [_step_row(f"run-{i:02d}", step)])


def test_sixteen_concurrent_writers_lose_no_commit(postgres_uri, tmp_path):
    home = str(tmp_path / "home")
    Lake.open(factory_home(home), uri=postgres_uri)  # creates the namespace and tables once
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(home, postgres_uri, i, start)) for i in range(WRITERS)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    lake = Lake.open(factory_home(home), uri=postgres_uri)
    rows = query("SELECT run_id, count(*) AS n FROM steps GROUP BY run_id ORDER BY run_id", lake).to_pylist()
    assert rows == [{"run_id": f"run-{i:02d}", "n": COMMITS} for i in range(WRITERS)]
    # every commit is its own snapshot: none was lost or merged away
    assert len(lake.table("steps").metadata.snapshots) >= WRITERS * COMMITS


def test_the_cli_reads_a_postgres_catalog(postgres_uri, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FACTORY_CATALOG_URI", postgres_uri)
    lake = Lake.open()  # the environment picks the Postgres catalog
    assert lake.catalog.engine.url.get_backend_name() == "postgresql"
    lake.upsert("steps", [_step_row("pg-run", 1), _step_row("pg-run", 2)])
    assert main(["query", "SELECT run_id, max(step) AS last FROM steps GROUP BY run_id", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"run_id": "pg-run", "last": 2}]
    assert main(["runs", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == []  # no `runs` rows were written: an empty list, from Postgres
    assert not (tmp_path / "home" / "lake" / "catalog.db").exists()  # no SQLite catalog was made beside it


def _proxied(postgres_uri: str) -> tuple[TcpProxy, str]:
    """A TcpProxy in front of the test's Postgres server, and the catalog URI through it."""
    url = make_url(postgres_uri)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
    return proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


def test_a_catalog_server_restart_leaves_no_dead_pooled_connection(postgres_uri, tmp_path):
    proxy, uri = _proxied(postgres_uri)
    try:
        lake = Lake.open(factory_home(str(tmp_path / "home")), uri=uri)
        lake.upsert("steps", [_step_row("restarted", 1)])  # the pool now holds connections to the server
        assert proxy.down() >= 1  # the server stops: every pooled connection dies
        proxy.up()  # and is back
        assert lake.read("steps").column("step").to_pylist() == [1]  # the first read after the restart
    finally:
        proxy.close()


def test_the_report_of_a_finished_run_waits_out_a_catalog_outage(postgres_uri, tmp_path):
    run_id = "outage-run"
    proxy, uri = _proxied(postgres_uri)
    try:
        lake = Lake.open(factory_home(str(tmp_path / "home")), uri=uri)
        lake.upsert("evals", [{"run_id": run_id, "step": step, "benchmark": HELD_OUT, "metric": "accuracy",
                               "value": value, "n": 500, "recorded_at": datetime.now(UTC)}
                              for step, value in ((0, 0.25), (3, 0.5))])
        proxy.down()  # the server is still down when the run ends
        said, waits = [], []

        def wait(seconds: float) -> None:  # the pause between tries: the server is back after the first
            waits.append(seconds)
            proxy.up()

        summary = report_when_up(lake, run_id, 300.0, said.append, sleep=wait)
        assert len(waits) == 1 and proxy.refused >= 1  # one try met the stopped server, the next read the report
        assert len(said) == 1 and said[0].startswith("lake unavailable (OperationalError)"), said
        assert (summary["sft_accuracy"], summary["grpo_accuracy"], summary["final_step"]) == (0.25, 0.5, 3)
        assert "0.250" in summary["report"] and "0.500" in summary["report"]
    finally:
        proxy.close()
