"""The quickstart's assets with everything that keeps records on a real PostgreSQL server: the Iceberg catalog
($FACTORY_CATALOG_URI), MLflow's backend ($FACTORY_MLFLOW_URI) and the Dagster instance's storage (dagster-postgres),
three databases on the machine's own server (tests/conftest.py `postgres_databases`; .ci/run starts it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dagster import instance_for_test, materialize

from factory.cli import main
from factory.cockpit.tracking import Tracker
from factory.lake import Lake, query
from jobs import ALL_CHECKS, QUICKSTART_ASSETS, make_resources

TINY = [
    "name=pgtest", "model.preset=micro", "task.n_train=300", "task.n_eval=40", "sft.steps=20",
    "sft.stop_at_accuracy=null", "rollout.prompts_per_step=4", "algorithm.group_size=4",
    "schedule.steps=3", "schedule.eval_pass_k=2",
]
SPEC = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")


@pytest.mark.slow
def test_quickstart_assets_on_postgres(postgres_databases, tmp_path, monkeypatch, capsys):
    catalog, mlflow, dagster = postgres_databases(), postgres_databases(), postgres_databases()
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FACTORY_CATALOG_URI", catalog)
    monkeypatch.setenv("FACTORY_MLFLOW_URI", mlflow)
    # the driver stays named in the URL: this SQLAlchemy's default Postgres driver is psycopg 3, not installed
    with instance_for_test(overrides={"storage": {"postgres": {"postgres_url": dagster}}}) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        result = materialize([*QUICKSTART_ASSETS, *ALL_CHECKS], resources=make_resources(SPEC, TINY, ""),
                             instance=instance)
        assert result.success
        assert instance.get_run_by_id(result.run_id).is_success  # the run's record is in Postgres
        assert instance.get_latest_materialization_event(QUICKSTART_ASSETS[2].key) is not None  # grpo_run
    run_id = result.asset_materializations_for_node("grpo_run")[0].metadata["run_id"].value
    lake = Lake.open()
    assert lake.catalog.engine.url.get_backend_name() == "postgresql"
    assert [r["step"] for r in query(f"SELECT step FROM steps WHERE run_id = '{run_id}' ORDER BY step",
                                     lake).to_pylist()] == [1, 2, 3]
    tracker = Tracker()
    assert tracker.tracking_uri == mlflow
    (run,) = tracker.client.search_runs([e.experiment_id for e in tracker.client.search_experiments()],
                                        f"tags.`factory.run_id` = '{run_id}'")
    assert run.info.status == "FINISHED"
    assert main(["runs", "--format", "json"]) == 0
    assert [(r["run_id"], r["status"]) for r in json.loads(capsys.readouterr().out)] == [(run_id, "succeeded")]
    assert not (tmp_path / "home" / "lake" / "catalog.db").exists() and not (tmp_path / "home" / "mlflow" /
                                                                             "mlflow.db").exists()
