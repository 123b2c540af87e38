"""The launches of the training launcher resource (resources/__init__.py `TrainingLauncherResource`), which picks one
per deployment: from the step's own process (`launch_here`: the run's `Pipeline`, in process or supervised), or
through Pipes.

Through Pipes: open a Pipes session, start `factory train-grpo` (a local child process,
or the trainer pods of deploy/cluster.py), read its messages, and turn its exit code into a retry decision. Built on
`open_pipes_session` rather than PipesSubprocessClient / PipesK8sClient because the launcher needs the exit code (4
= needs a fix, 8 = the engine's log-probs disagree with the trainer's: no retry) and the Kubernetes run is an
Indexed Job of several pods, not the single pod PipesK8sClient starts; the protocol (context in env, messages in a
temp file or rank 0's log) is theirs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dagster import (
    AssetExecutionContext,
    Failure,
    MaterializeResult,
    PipesEnvContextInjector,
    PipesTempFileMessageReader,
    open_pipes_session,
)

from factory.deploy.profile import ProfileError, load_profile
from factory.deploy.target import DEPLOY_PROFILE_ENV
from factory.progress import Log
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_LOGPROB_GAP, EXIT_NEEDS_FIX
from factory.runs.supervision import Supervision

if TYPE_CHECKING:
    from factory.cockpit.tracking import Tracker
    from factory.config import ExperimentSpec
    from factory.lake.writer import Lake
    from factory.runs.stages import ProgressCallback
    from resources import FactoryHomeResource, SpecResource, TrainingLauncherResource


class TrainingHere(Protocol):
    """What an asset gives the launcher for its run: the records, and the Dagster-side guards of training from the
    step's own process (assets/training.py has one)."""

    lake: Lake
    tracker: Tracker
    log: Log
    progress: ProgressCallback | None

    def guard(self) -> AbstractContextManager[object]:
        """Around a run trained from this process: the preflight gate, the end of an earlier attempt still alive, no
        retry for what needs a fix, the run worker watched."""

    def watch(self) -> AbstractContextManager[object]:
        """Around a Pipes launch: the run worker watched (a local `factory train-grpo` child watches it too)."""


def launch_here(context: AssetExecutionContext, spec: ExperimentSpec, home: FactoryHomeResource,
                read_inputs: Callable[[], dict[str, Any]], here: TrainingHere,
                supervision: Supervision) -> dict[str, Any]:
    """The run trained from the step's own process by its `Pipeline`, supervised as `supervision` says; its scalars.
    `read_inputs` is called inside the step's guards (the preflight gate first)."""
    from factory.runs.pipeline import Pipeline  # noqa: PLC0415 heavy: torch, for a launch only
    from factory.runs.pipes import run_scalars  # noqa: PLC0415 heavy: torch, for a launch only

    with here.guard():
        inputs = read_inputs()
        res = Pipeline(spec, home.paths(), log=here.log, progress=here.progress).train(
            inputs["init_checkpoint"], Path(inputs["dataset"]), here.lake, here.tracker, supervision,
            run_id=inputs["run_id"])
    return run_scalars(res)


def _watched(here: TrainingHere | None) -> AbstractContextManager[object]:
    return nullcontext() if here is None else here.watch()


def reported_scalars(reported: MaterializeResult) -> dict[str, Any]:
    """The scalars a Pipes entrypoint reported (its materialization's metadata values)."""
    return {k: v.value for k, v in (reported.metadata or {}).items()}


def check_exit(code: int | None, where: str) -> None:
    """Raise the Failure a non-zero exit calls for: retryable, unless the run needs a person first."""
    if code == 0:
        return
    if code in (EXIT_BAD_INPUT, EXIT_NEEDS_FIX, EXIT_LOGPROB_GAP):
        raise Failure(description=f"{where} exited with {code} (needs a fix: see the run's log); not retried",
                      allow_retries=False)
    raise Failure(description=f"{where} exited with {code}")


def _result(session: Any, where: str) -> MaterializeResult:
    results = [r for r in session.get_results(implicit_materializations=False) if isinstance(r, MaterializeResult)]
    if not results:
        raise Failure(description=f"{where} exited 0 without reporting a materialization through Pipes")
    return results[0]


def launch_subprocess(context: AssetExecutionContext, spec: SpecResource, home: FactoryHomeResource,
                      inputs: dict[str, Any], here: TrainingHere | None = None) -> dict[str, Any]:
    """`factory train-grpo` as a child process of this step (context in its environment, messages through a temp
    file, as PipesSubprocessClient does); its reported scalars."""
    with _watched(here):
        return reported_scalars(_subprocess(context, spec, home, inputs))


def _subprocess(context: AssetExecutionContext, spec: SpecResource, home: FactoryHomeResource,
                inputs: dict[str, Any]) -> MaterializeResult:
    cmd = [sys.executable, "-m", "factory.cli", "--home", str(home.paths().root), "train-grpo", spec.path]
    for o in spec.overrides:
        cmd += ["--set", o]
    with open_pipes_session(context=context, extras=inputs, context_injector=PipesEnvContextInjector(),
                            message_reader=PipesTempFileMessageReader()) as session:
        code = subprocess.run(cmd, env={**os.environ, **session.get_bootstrap_env_vars()}, check=False).returncode
    check_exit(code, "train-grpo")
    return _result(session, "train-grpo")


def launch_k8s(context: AssetExecutionContext, spec: ExperimentSpec, launcher: TrainingLauncherResource,
               inputs: dict[str, Any], here: TrainingHere | None = None) -> dict[str, Any]:
    """The run's rollout servers and trainer pods on the cluster (deploy/cluster.py); its reported scalars."""
    with _watched(here):
        return reported_scalars(_k8s(context, spec, launcher, inputs))


def _k8s(context: AssetExecutionContext, spec: ExperimentSpec, launcher: TrainingLauncherResource,
         inputs: dict[str, Any]) -> MaterializeResult:
    """Pipes context in the trainers' environment, messages read from rank 0's log (dagster-k8s's pod-log reader)."""
    from dagster_k8s.pipes import PipesK8sPodLogsMessageReader  # noqa: PLC0415 heavy: kubernetes, k8s only

    from factory.deploy.cluster import (  # noqa: PLC0415 heavy: ~1 s, k8s only
        Cluster,
        ClusterError,
        launch_run,
        run_objects,
    )

    try:
        profile = load_profile(launcher.deploy_profile or os.environ.get(DEPLOY_PROFILE_ENV) or None)
    except ProfileError as e:
        raise Failure(description=str(e), allow_retries=False) from None
    try:
        cluster = Cluster.connect(profile.namespace, launcher.kubeconfig or None, poll_s=launcher.poll_s)
    except Exception as e:  # noqa: BLE001 - kubernetes' config errors have no common base worth naming
        where = f"launcher.kubeconfig {launcher.kubeconfig}" if launcher.kubeconfig else "in-cluster config"
        raise Failure(description=f"cannot reach the cluster ({where}): {e}", allow_retries=False) from None
    reader = PipesK8sPodLogsMessageReader()
    with open_pipes_session(context=context, extras=inputs, context_injector=PipesEnvContextInjector(),
                            message_reader=reader) as session:
        objs = run_objects(spec, profile, dict(session.get_bootstrap_env_vars()))
        try:
            outcome = launch_run(
                cluster, objs, lambda pod: reader.consume_pod_logs(context, cluster.core, pod, cluster.namespace),
                launcher.ready_timeout_s, launcher.run_timeout_s, log=context.log.info)
        except ClusterError as e:
            raise Failure(description=str(e)) from None
    if not outcome.succeeded:
        check_exit(outcome.exit_code if outcome.exit_code is not None else 1,
                   f"Job {objs.job_name} ({outcome.reason or 'failed'})")
    return _result(session, f"Job {objs.job_name}")
