"""`factory query` and `factory runs`: output, formats and exit codes, through main(argv)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from factory.cli import build_parser, main
from factory.home import FactoryPaths
from factory.lake import Lake

T0 = dt.datetime(2025, 5, 6, 7, 8, 9, tzinfo=dt.UTC)


@pytest.fixture
def runs_recorded(factory_home: FactoryPaths) -> FactoryPaths:
    """Two runs: r1 finished with an accuracy eval at its last step, r2 still running."""
    with Lake.open(factory_home) as lake:
        run = dict(spec="{}", spec_fingerprint="f", code_version="c", seed=0)
        lake.upsert("runs", [dict(run, run_id="r1", name="first", status="succeeded", started_at=T0,
                                  ended_at=T0 + dt.timedelta(minutes=5)),
                             dict(run, run_id="r2", name="second", status="running",
                                  started_at=T0 + dt.timedelta(hours=1))])
        lake.upsert("steps", [dict(run_id=r, step=s, weight_version=s, loss=1.0, recorded_at=T0)
                              for r, n in (("r1", 3), ("r2", 2)) for s in range(1, n + 1)])
        ev = dict(run_id="r1", benchmark="arith", n=50, recorded_at=T0)
        lake.upsert("evals", [dict(ev, step=0, metric="accuracy", value=0.2),
                              dict(ev, step=3, metric="accuracy", value=0.7),
                              dict(ev, step=3, metric="pass_at_8", value=0.9),
                              dict(ev, run_id="r2", step=1, metric="accuracy", value=0.3)])
    return factory_home


def test_query_prints_json_and_exits_0(runs_recorded, capsys):
    code = main(["query", "SELECT run_id, count(*) AS n FROM steps GROUP BY run_id ORDER BY run_id",
                 "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert json.loads(out) == [{"run_id": "r1", "n": 3}, {"run_id": "r2", "n": 2}]


def test_query_table_format_by_default(runs_recorded, capsys):
    assert main(["query", "SELECT name, status FROM runs ORDER BY name"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "status"] and out[2].split() == ["first", "succeeded"]
    assert out[-1] == "(2 rows)"


@pytest.mark.slow
@pytest.mark.parametrize("sql", ["SELEC 1", "SELECT * FROM no_such_table", "SELECT nope FROM runs"])
def test_bad_sql_exits_2_with_one_line_error(runs_recorded, capsys, sql):
    assert main(["query", sql]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("factory: error: ") and err.count("\n") == 1


@pytest.mark.slow
def test_runs_lists_each_runs_result(runs_recorded, capsys):
    assert main(["runs", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_id"] for r in rows] == ["r2", "r1"]  # newest first
    r2, r1 = rows
    assert r1["final_step"] == 3 and r1["status"] == "succeeded"
    assert (r1["benchmark"], r1["eval_step"], r1["accuracy"], r1["ci95"], r1["n"]) == ("arith", 3, 0.7,
                                                                                      "[0.562, 0.809]", 50)
    assert r1["ended_at"] == "2025-05-06T07:13:09+00:00" and r1["other_benchmarks"] is None
    # r2 has trained to step 2 but its latest accuracy eval is of step 1: its result so far, and the step it is of.
    assert (r2["final_step"], r2["eval_step"], r2["accuracy"], r2["ended_at"]) == (2, 1, 0.3, None)


def test_runs_on_an_empty_home_and_csv(factory_home, capsys):
    assert main(["runs", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("run_id,name,status,started_at")


def test_home_flag_overrides_env(runs_recorded, tmp_path, capsys):
    assert main(["--home", str(tmp_path / "other"), "query", "SELECT count(*) AS n FROM runs",
                 "-f", "csv"]) == 0
    assert capsys.readouterr().out.split() == ["n", "0"]


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["query", "SELECT 1", "--format", "xml"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert {"query", "runs"} <= set(build_parser()._subparsers._group_actions[0].choices)


@pytest.mark.slow
def test_module_entry_point_exit_code(factory_home):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "factory.cli", "query", "SELEC 1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("factory: error: Parser Error")
