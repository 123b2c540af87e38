"""The Dagster side of training through Pipes: open a Pipes session, start `factory train-grpo` (a local child process,
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
from typing import TYPE_CHECKING, Any

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
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_LOGPROB_GAP, EXIT_NEEDS_FIX

if TYPE_CHECKING:
    from factory.config import ExperimentSpec
    from resources import FactoryHomeResource, SpecResource, TrainingLauncherResource


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
                      inputs: dict[str, Any]) -> MaterializeResult:
    """`factory train-grpo` as a child process of this step (context in its environment, messages through a temp
    file, as PipesSubprocessClient does)."""
    cmd = [sys.executable, "-m", "factory.cli", "--home", str(home.paths().root), "train-grpo", spec.path]
    for o in spec.overrides:
        cmd += ["--set", o]
    with open_pipes_session(context=context, extras=inputs, context_injector=PipesEnvContextInjector(),
                            message_reader=PipesTempFileMessageReader()) as session:
        code = subprocess.run(cmd, env={**os.environ, **session.get_bootstrap_env_vars()}, check=False).returncode
    check_exit(code, "train-grpo")
    return _result(session, "train-grpo")


def launch_k8s(context: AssetExecutionContext, spec: ExperimentSpec, launcher: TrainingLauncherResource,
               inputs: dict[str, Any]) -> MaterializeResult:
    """The run's rollout servers and trainer pods on the cluster (deploy/cluster.py); Pipes context in the
    trainers' environment, messages read from rank 0's log (dagster-k8s's pod-log reader)."""
    from dagster_k8s.pipes import PipesK8sPodLogsMessageReader  # heavy: kubernetes

    from factory.deploy.cluster import Cluster, ClusterError, launch_run, run_objects  # heavy: ~1 s, k8s only

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
