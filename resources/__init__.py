"""Dagster resources: thin ConfigurableResources over FACTORY_HOME, the Iceberg lake and MLflow."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from dagster import ConfigurableResource
from pydantic import Field

from factory.config import ExperimentSpec, parse_overrides
from factory.envs.spec_check import load_checked_spec
from factory.home import FactoryPaths, factory_home
from factory.runs.supervision import Supervision

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
        from factory.lake.writer import Lake  # noqa: PLC0415 heavy: pyiceberg (loading the code location stays light)

        return Lake.open(self.home.paths())


class MlflowResource(ConfigurableResource):
    """MLflow tracking: $FACTORY_MLFLOW_URI (a team's Postgres or tracking server), else SQLite under FACTORY_HOME."""

    home: FactoryHomeResource

    def tracker(self) -> Tracker:
        from factory.cockpit.tracking import Tracker  # noqa: PLC0415 heavy: mlflow

        return Tracker(self.home.paths())


class SpecResource(ConfigurableResource):
    """The experiment spec the assets build: a YAML file plus `path=value` overrides (values are YAML)."""

    path: str = "examples/quickstart.yaml"
    overrides: list[str] = []

    def spec(self) -> ExperimentSpec:
        return load_checked_spec(self.path, parse_overrides(self.overrides))


class TrainingLauncherResource(ConfigurableResource):
    """Where and how the training assets train, per deployment (the assets call it; it decides): `in_process` (the
    local default: in the step's own process), `supervised` (attempts in child processes of the step, restarted when
    one dies or hangs, as `factory run` does), `subprocess` (a child process on this machine that reports back through
    Dagster Pipes), or `k8s` (an Indexed Job of trainer pods and the run's rollout servers on the cluster, reporting
    back through Pipes; FACTORY_PROFILE=k8s selects it). The two Pipes launches run the same entrypoint (`factory
    train-grpo`, factory/runs/pipes.py); every launch gives the same metadata. Sweep members train in the step's own
    process, `supervised` or not as this says."""

    where: str = Field("in_process", description="in_process | supervised | subprocess | k8s")
    kubeconfig: str = Field("", description="k8s: kubeconfig file; empty: the pod's in-cluster service account")
    deploy_profile: str = Field("", description="k8s: deploy profile YAML; empty: $FACTORY_DEPLOY_PROFILE, else the "
                                "built-in defaults")
    ready_timeout_s: float = Field(1800.0, gt=0, description="k8s: how long the rollout servers and rank 0's pod "
                                   "may take to start (image pulls, model loading)")
    run_timeout_s: float = Field(7 * 24 * 3600.0, gt=0, description="k8s: how long the trainer Job may run")
    poll_s: float = Field(5.0, gt=0, description="k8s: seconds between status reads")

    def supervision(self) -> Supervision:
        """How a run trained from the step's own process is supervised here (a Pipes launch's entrypoint trains in
        its own process, and a sweep member trains in its step's process under any launcher but `supervised`)."""
        return Supervision.SUPERVISED if self.where == WHERE_SUPERVISED else Supervision.IN_PROCESS

    def launch(self, context, spec: SpecResource, home: FactoryHomeResource, inputs: Callable[[], dict], here) -> dict:
        """Train the run of `inputs()` where this deployment says; return its scalars (factory/runs/pipes.py
        `run_scalars`). `here` (resources/launch.py `TrainingHere`) is what training from the step's own process
        needs around it; `inputs` is called once its checks passed (the preflight gate names a failed node first,
        even when an upstream is missing too)."""
        from resources.launch import launch_here, launch_k8s, launch_subprocess  # noqa: PLC0415 heavy, a launch only

        if self.where in (WHERE_IN_PROCESS, WHERE_SUPERVISED):
            return launch_here(context, spec.spec(), home, inputs, here, self.supervision())
        if self.where == "subprocess":
            return launch_subprocess(context, spec, home, inputs(), here)
        if self.where == "k8s":
            return launch_k8s(context, spec.spec(), self, inputs(), here)
        raise ValueError(f"launcher.where: expected in_process, supervised, subprocess or k8s, got {self.where!r}")


WHERE_IN_PROCESS, WHERE_SUPERVISED = Supervision.IN_PROCESS.value, Supervision.SUPERVISED.value
