"""Dagster resources: thin ConfigurableResources over FACTORY_HOME, the Iceberg lake and MLflow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dagster import ConfigurableResource
from pydantic import Field

from factory.config import ExperimentSpec, apply_overrides, load_spec, parse_overrides
from factory.home import FactoryPaths, factory_home

if TYPE_CHECKING:  # imported when used: the code location loads without pyiceberg and mlflow
    from factory.lake.writer import Lake
    from factory.tracking import Tracker


class FactoryHomeResource(ConfigurableResource):
    """Where all state lives: the Iceberg lake, MLflow, checkpoints, sweeps (FACTORY_HOME)."""

    root: str = Field("", description="FACTORY_HOME directory; leave empty for $FACTORY_HOME, else ./.factory "
                      "(what `make demo` and `make ui` use)")

    def paths(self) -> FactoryPaths:
        return factory_home(self.root or None)


class LakeResource(ConfigurableResource):
    """The Iceberg catalog: $FACTORY_CATALOG_URI (a team's Postgres), else a SQLite SqlCatalog under FACTORY_HOME."""

    home: FactoryHomeResource

    def lake(self) -> Lake:
        from factory.lake.writer import Lake

        return Lake.open(self.home.paths())


class MlflowResource(ConfigurableResource):
    """MLflow tracking: $FACTORY_MLFLOW_URI (a team's Postgres or tracking server), else SQLite under FACTORY_HOME."""

    home: FactoryHomeResource

    def tracker(self) -> Tracker:
        from factory.tracking import Tracker

        return Tracker(self.home.paths())


class SpecResource(ConfigurableResource):
    """The experiment spec the assets build: a YAML file plus `path=value` overrides (values are YAML)."""

    path: str = "examples/quickstart.yaml"
    overrides: list[str] = []

    def spec(self) -> ExperimentSpec:
        return apply_overrides(load_spec(self.path), parse_overrides(self.overrides))
