"""Where a tpe sweep's study is stored, read from the Dagster instance that runs the sweep."""

import sqlalchemy
import yaml
from dagster import DagsterInstance

from factory.cockpit.sweep_search import studies_db
from resources.study import instance_postgres_url, study_storage_for, sweep_study

INFO = {"sweep_id": "tpe-1", "definition": {"prune": "median", "prune_startup_trials": 1},
        "search": {"steps": 8, "eval_every": 2}}


def test_an_instance_on_sqlite_keeps_studies_in_a_file_under_factory_home(factory_home):
    with DagsterInstance.ephemeral() as instance:
        assert instance_postgres_url(instance) is None
        assert study_storage_for(instance, factory_home) == f"sqlite:///{studies_db(factory_home)}"
        study = sweep_study(instance, factory_home, INFO)
    assert study.study_name == "tpe-1" and studies_db(factory_home).is_file()
    assert study.pruner._n_startup_trials == 1  # the definition's pruner, not Optuna's default


def test_an_instance_on_postgres_keeps_studies_in_its_database(factory_home, tmp_path, postgres_uri):
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump({"storage": {"postgres": {"postgres_url": postgres_uri}}}))
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        assert instance_postgres_url(instance) == postgres_uri
        assert study_storage_for(instance, factory_home) == postgres_uri
        assert sweep_study(instance, factory_home, INFO).study_name == "tpe-1"
    assert not studies_db(factory_home).exists()
    engine = sqlalchemy.create_engine(postgres_uri)
    with engine.connect() as conn:
        versions = {s: conn.execute(sqlalchemy.text(f"SELECT version_num FROM {s}.alembic_version")).scalar()
                    for s in ("public", "optuna")}
        studies = conn.execute(sqlalchemy.text("SELECT study_name FROM optuna.studies")).scalars().all()
    engine.dispose()
    # One database, two alembic histories: Dagster's in public, Optuna's in its own schema, neither overwritten.
    assert versions["public"] != versions["optuna"] and None not in versions.values()
    assert studies == ["tpe-1"]
