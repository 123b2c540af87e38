"""A tpe sweep's Optuna study, opened on the database of the Dagster instance that runs the sweep.

The instance's Postgres when its storage is on Postgres (`storage: postgres:` or the older `run_storage:` of
dagster-postgres in dagster.yaml), else the SQLite file under FACTORY_HOME (`factory.cockpit.sweep_search`). The op that
plans a sweep, the launcher sensor and every member's step all open the study here, so they agree on where it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dagster import DagsterInstance

from factory.cockpit.sweep_search import open_storage, open_study, study_storage_url
from factory.home import FactoryPaths

if TYPE_CHECKING:
    import optuna


def instance_postgres_url(instance: DagsterInstance) -> str | None:
    """The Postgres URL of the instance's run storage (dagster-postgres keeps it as `postgres_url`), else None."""
    url = getattr(instance.run_storage, "postgres_url", None)
    return url if isinstance(url, str) and url else None


def study_storage_for(instance: DagsterInstance, paths: FactoryPaths) -> str:
    """Where the studies of sweeps run by `instance` are stored (a SQLAlchemy URL)."""
    return study_storage_url(paths, instance_postgres_url(instance))


def sweep_study(instance: DagsterInstance, paths: FactoryPaths, info: dict[str, Any]) -> optuna.Study:
    """The study of the tpe sweep stored as `info` (`factory.cockpit.sweep.read_sweep`), created on first use."""
    search = info.get("search") or {}
    return open_study(open_storage(study_storage_for(instance, paths)), info["sweep_id"], info["definition"],
                      base_steps=int(search.get("steps", 1)), eval_every=search.get("eval_every"))
