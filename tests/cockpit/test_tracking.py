"""Tracker: runs, params, metrics, tags and artifacts land in MLflow's SQLite store and can be read
back by an independent MlflowClient; processes starting together on a fresh home all get a complete store."""

from __future__ import annotations

import contextlib
import math
import sqlite3

import pytest
from mlflow import MlflowClient

from factory.cockpit.tracking import Tracker, flatten_params
from factory.home import factory_home
from factory.lake import Lake
from tests.racing import race


@pytest.fixture(scope="module")
def tracker(tmp_path_factory) -> Tracker:
    # One MLflow DB for the module: creating its schema takes a few seconds.
    return Tracker(factory_home(tmp_path_factory.mktemp("tracking-home")))


@pytest.mark.slow
def test_run_round_trip_through_a_new_client(tracker: Tracker, tmp_path):
    params = {"model": {"preset": "micro", "layers": 2}, "lr": 1e-3, "mode": "sync", "empty": {}}
    run_id = tracker.start_run("arith", "run-1", params=params, tags={"factory.run_id": "r1", "seed": 7})
    assert tracker.log_metrics(run_id, 1, {"loss": 2.0, "kl": None, "reward": 0.1}) == 2
    tracker.log_metrics(run_id, 2, {"loss": 1.5, "reward": float("nan")})
    tracker.set_tags(run_id, {"factory.checkpoint": "/ckpt/final"})
    artifact = tmp_path / "report.md"
    artifact.write_text("# report\n")
    tracker.log_artifact(run_id, artifact)
    tracker.end_run(run_id, "FINISHED")

    client = MlflowClient(tracking_uri=f"sqlite:///{tracker.paths.mlflow_db}")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-1"
    assert run.data.params == {"model.preset": "micro", "model.layers": "2", "lr": "0.001",
                               "mode": "sync", "empty": "{}"}
    assert run.data.tags["factory.run_id"] == "r1" and run.data.tags["seed"] == "7"
    assert run.data.tags["factory.checkpoint"] == "/ckpt/final"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(1, 2.0), (2, 1.5)]
    assert "kl" not in run.data.metrics
    assert math.isnan(run.data.metrics["reward"])
    assert tracker.metric_history(run_id, "loss") == [(1, 2.0), (2, 1.5)]
    assert [a.path for a in client.list_artifacts(run_id)] == ["report.md"]
    assert run.info.artifact_uri.startswith(tracker.paths.mlflow_artifacts.as_uri())
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "arith"


def test_many_runs_in_one_process_and_failed_status(tracker: Tracker):
    a = tracker.start_run("sweep", "a", params={"lr": 1})
    b = tracker.start_run("sweep", "b", params={"lr": 2})
    tracker.log_metrics(a, 0, {"loss": 1.0})
    tracker.log_metrics(b, 0, {"loss": 9.0})
    tracker.end_run(b, "FAILED")
    assert tracker.get_run(a).info.status == "RUNNING"
    assert tracker.get_run(b).info.status == "FAILED"
    assert tracker.metric_history(a, "loss") == [(0, 1.0)] and tracker.metric_history(b, "loss") == [(0, 9.0)]
    assert tracker.get_run(a).info.experiment_id == tracker.get_run(b).info.experiment_id


def test_params_are_made_safe_for_mlflow(tracker: Tracker):
    flat = flatten_params({"a": {"b": {"c": 1}}, "weird key[0]": "x", "long": "y" * 10_000})
    assert flat["a.b.c"] == "1" and flat["weird key_0_"] == "x"
    assert len(flat["long"]) == 6000 and flat["long"].endswith("...")
    run_id = tracker.start_run("limits", "r", params={"long": "y" * 10_000, "weird key[0]": "x"})
    assert len(tracker.get_run(run_id).data.params["long"]) == 6000


def test_non_numeric_metric_is_named(tracker: Tracker):
    run_id = tracker.start_run("limits", "bad-metric")
    with pytest.raises(TypeError, match="metric 'loss'"):
        tracker.log_metrics(run_id, 0, {"loss": "low"})


@pytest.mark.slow
def test_first_use_of_a_home_is_quiet(factory_home, capfd):
    Tracker()  # $FACTORY_HOME from the fixture; a brand-new MLflow DB
    out, err = capfd.readouterr()
    assert "Creating initial MLflow database tables" not in out + err
    assert factory_home.mlflow_db.exists()


def test_log_png_round_trips_through_the_artifact_store(tracker: Tracker, tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4  # only the bytes matter to the store
    run_id = tracker.start_run("pictures", "with-png")
    tracker.log_png(run_id, "plots/curves.png", png)
    tracker.log_png(run_id, "top.png", png[:100])

    client = MlflowClient(tracking_uri=f"sqlite:///{tracker.paths.mlflow_db}")
    assert sorted(a.path for a in client.list_artifacts(run_id)) == ["plots", "top.png"]
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/curves.png"]
    local = client.download_artifacts(run_id, "plots/curves.png", str(tmp_path))
    assert open(local, "rb").read() == png
    with pytest.raises(ValueError, match="names no file"):
        tracker.log_png(run_id, "plots/", png)


def test_nested_run_carries_the_parent_tag(tracker: Tracker):
    parent = tracker.start_run("nesting", "sweep", tags={"factory.sweep_id": "s1"})
    kids = [tracker.start_run("nesting", f"member-{i}", tags={"i": i}, parent_run_id=parent) for i in range(2)]
    loner = tracker.start_run("nesting", "unrelated")

    assert tracker.get_run(kids[0]).data.tags["mlflow.parentRunId"] == parent
    assert tracker.get_run(kids[0]).data.tags["i"] == "0"
    assert "mlflow.parentRunId" not in tracker.get_run(loner).data.tags
    exp_id = tracker.get_run(parent).info.experiment_id
    found = tracker.client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.info.run_id for r in found) == sorted(kids)


def test_links_open_the_training_view_and_experiments_say_they_hold_training(tracker: Tracker, monkeypatch):
    """MLflow 3 opens in its GenAI view unless the link's `workflowType` says otherwise; experiments carry the
    machine-learning kind, set on ones made before too, and a kind someone chose is kept."""
    monkeypatch.setenv("FACTORY_MLFLOW_UI", "http://mlflow.example:5000/")
    run_id = tracker.start_run("views", "r1")
    exp_id = tracker.get_run(run_id).info.experiment_id
    assert tracker.run_url(run_id) == (f"http://mlflow.example:5000/#/experiments/{exp_id}/runs/{run_id}"
                                       "?workflowType=machine_learning")
    assert tracker.client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "custom_model_development"

    older = tracker.client.create_experiment("made-before")  # as an older Factory made them: no kind
    chosen = tracker.client.create_experiment("chosen", tags={"mlflow.experimentKind": "genai_development"})
    tracker.start_run("made-before", "r2")
    tracker.start_run("chosen", "r3")
    assert tracker.client.get_experiment(older).tags["mlflow.experimentKind"] == "custom_model_development"
    assert tracker.client.get_experiment(chosen).tags["mlflow.experimentKind"] == "genai_development"


def test_a_sweeps_link_charts_its_members_flat(tracker: Tracker, monkeypatch):
    """MLflow folds members under the parent, collapsed, and charts only shown rows: the sweep's link filters to
    its members and sorts by name, which MLflow lists flat, in the chart view of the training workflow."""
    import urllib.parse

    monkeypatch.setenv("FACTORY_MLFLOW_UI", "http://127.0.0.1:5000")
    parent = tracker.start_run("sweep-view", "sweep", tags={"factory.sweep_id": "s-1"})
    exp_id = tracker.get_run(parent).info.experiment_id
    url = tracker.sweep_url(parent, "s-1")
    base, _, query = url.partition("?")
    assert base == f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs"
    assert urllib.parse.parse_qs(query) == {
        "workflowType": ["machine_learning"], "searchFilter": ["tags.`factory.sweep_id` = 's-1'"],
        "orderByKey": ["tags.`mlflow.runName`"], "orderByAsc": ["true"], "compareRunsMode": ["CHART"]}
    # the filter is one MLflow accepts, and it finds the members
    kids = [tracker.start_run("sweep-view", f"m{i}", tags={"factory.sweep_id": "s-1"}, parent_run_id=parent)
            for i in range(2)]
    found = tracker.client.search_runs([exp_id], filter_string=urllib.parse.parse_qs(query)["searchFilter"][0])
    assert set(kids) <= {r.info.run_id for r in found}


# One process of the start-up race: open both stores on the fresh home and write an MLflow run and an Iceberg row.
_SET_UP = """
import datetime as dt
from factory.home import factory_home
from factory.lake import Lake
from factory.cockpit.tracking import Tracker
paths = factory_home(root)
tracker = Tracker(paths)
run_id = tracker.start_run("race", name)
tracker.log_metrics(run_id, 0, {"loss": 1.0})
tracker.end_run(run_id)
with Lake.open(paths) as lake:
    lake.upsert("steps", [dict(run_id=name, step=0, weight_version=0, loss=1.0,
                               recorded_at=dt.datetime(2025, 1, 1, tzinfo=dt.UTC))])
"""


@pytest.mark.slow
def test_processes_starting_together_on_a_fresh_home_all_succeed(tmp_path):
    n = 5
    root = race(tmp_path, _SET_UP, n)

    # A later process finds a complete home: every racer's run and row, and it can write its own.
    paths = factory_home(root)
    tracker = Tracker(paths)
    exp = tracker.client.get_experiment_by_name("race")
    runs = tracker.client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"p{i}" for i in range(n)]
    assert all(r.info.status == "FINISHED" and r.data.metrics == {"loss": 1.0} for r in runs)
    tracker.end_run(tracker.start_run("race", "later"))
    with Lake.open(paths) as lake:
        assert sorted(lake.read("steps")["run_id"].to_pylist()) == [f"p{i}" for i in range(n)]
    assert not list(paths.mlflow_db.parent.glob("mlflow.db.setup-*"))


@pytest.mark.slow
def test_half_made_store_without_runs_is_rebuilt_and_one_with_runs_refused(tmp_path):
    # What a racing first set-up used to leave: some tables, an Alembic revision short of the head.
    paths = factory_home(tmp_path / "home")
    with contextlib.closing(sqlite3.connect(paths.mlflow_db)) as conn:
        conn.executescript("CREATE TABLE experiments (experiment_id INTEGER PRIMARY KEY);"
                           "CREATE TABLE alembic_version (version_num TEXT); INSERT INTO alembic_version VALUES ('x');")
    tracker = Tracker(paths)
    tracker.end_run(tracker.start_run("after-repair", "r"))
    assert len(list(paths.mlflow_db.parent.glob("mlflow.db.incomplete-*"))) == 1  # moved aside, not deleted

    other = factory_home(tmp_path / "other")
    with contextlib.closing(sqlite3.connect(other.mlflow_db)) as conn:
        conn.executescript("CREATE TABLE runs (run_uuid TEXT); INSERT INTO runs VALUES ('precious');")
    with pytest.raises(RuntimeError, match=r"mlflow\.db is incomplete or out of date and holds runs"):
        Tracker(other)
    with contextlib.closing(sqlite3.connect(other.mlflow_db)) as conn:
        assert conn.execute("SELECT run_uuid FROM runs").fetchall() == [("precious",)]
