"""Dagster resources: thin ConfigurableResources over FACTORY_HOME, the Iceberg lake and MLflow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dagster import ConfigurableResource
from pydantic import Field

from factory.config import ExperimentSpec, parse_overrides
from factory.envs.spec_check import load_checked_spec
from factory.home import FactoryPaths, factory_home

if TYPE_CHECKING:  # imported when used: the code location loads without pyiceberg and mlflow
    from factory.cockpit.tracking import Tracker
    from factory.lake.writer import Lake


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
        from factory.lake.writer import Lake  # noqa: PLC0415 heavy: pyiceberg, duckdb

        return Lake.open(self.home.paths())


class MlflowResource(ConfigurableResource):
    """MLflow tracking: $FACTORY_MLFLOW_URI (a team's Postgres or tracking server), else SQLite under FACTORY_HOME."""

    home: FactoryHomeResource

    def tracker(self) -> Tracker:
        from factory.cockpit.tracking import Tracker  # noqa: PLC0415 heavy: mlflow; the code location loads without it

        return Tracker(self.home.paths())


class SpecResource(ConfigurableResource):
    """The experiment spec the assets build: a YAML file plus `path=value` overrides (values are YAML)."""

    path: str = "examples/quickstart.yaml"
    overrides: list[str] = []

    def spec(self) -> ExperimentSpec:
        return load_checked_spec(self.path, parse_overrides(self.overrides))


class TrainingLauncherResource(ConfigurableResource):
    """Where the `grpo_run` asset trains: `in_process` (the local default), `subprocess` (a child process on this
    machine that reports back through Dagster Pipes), or `k8s` (an Indexed Job of trainer pods and the run's
    rollout servers on the cluster, reporting back through Pipes; FACTORY_PROFILE=k8s selects it). The two Pipes
    launches run the same entrypoint (`factory train-grpo`, factory/runs/pipes.py) and give the same metadata."""

    where: str = Field("in_process", description="in_process | subprocess | k8s")
    kubeconfig: str = Field("", description="k8s: kubeconfig file; empty: the pod's in-cluster service account")
    deploy_profile: str = Field("", description="k8s: deploy profile YAML; empty: $FACTORY_DEPLOY_PROFILE, else the "
                                "built-in defaults")
    ready_timeout_s: float = Field(1800.0, gt=0, description="k8s: how long the rollout servers and rank 0's pod "
                                   "may take to start (image pulls, model loading)")
    run_timeout_s: float = Field(7 * 24 * 3600.0, gt=0, description="k8s: how long the trainer Job may run")
    poll_s: float = Field(5.0, gt=0, description="k8s: seconds between status reads")

    def launch(self, context, spec: SpecResource, home: FactoryHomeResource, inputs: dict):
        """Train through Pipes; return the materialization the entrypoint reported (a MaterializeResult)."""
        from resources.launch import launch_k8s, launch_subprocess  # noqa: PLC0415 the deploy profile; launches only

        if self.where == "subprocess":
            return launch_subprocess(context, spec, home, inputs)
        if self.where == "k8s":
            return launch_k8s(context, spec.spec(), self, inputs)
        raise ValueError(f"launcher.where: expected in_process, subprocess or k8s, got {self.where!r}")
