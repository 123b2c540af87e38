"""Launching a spec's GRPO run on a Kubernetes cluster, through the official `kubernetes` client: per run, the
sandbox pool and the SGLang rollout servers (a Deployment + Service each) are created and waited on until ready,
then the trainer ranks (headless Service + Indexed Job running `factory train-grpo`), and every object is deleted
when the run ends, whatever the outcome. `Cluster` holds the client calls; `launch_run` is the sequence; the
Dagster side (resources/, Pipes) hands it the Pipes environment and a function that follows rank 0's log.

Objects are per run and owned by Factory, so one left by an earlier launch of the same spec (an orchestrator that
died) is deleted and created again rather than patched; ConfigMaps are replaced.

Not run against a real API server (docs/kubernetes.md): tests/deploy drive it against a fake API
server on 127.0.0.1 that validates every body it receives against the Kubernetes schemas and runs the Job's
command as a local process. Scheduling, image pulls, RBAC and NCCL between pods are unproven.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from factory.config import ExperimentSpec
from factory.deploy import manifests as m
from factory.deploy.profile import DeployProfile
from factory.progress import Log

_log = logging.getLogger(__name__)

# kind -> (API group, the client's method suffix)
_KINDS = {"ConfigMap": ("core", "config_map"), "Service": ("core", "service"),
          "Deployment": ("apps", "deployment"), "Job": ("batch", "job")}
TRAIN_COMMAND = "train-grpo"


class ClusterError(RuntimeError):
    """The cluster refused an object or did not reach a state in time; the message names the object."""


@dataclass(frozen=True)
class JobOutcome:
    succeeded: bool
    exit_code: int | None  # rank 0's pod (completion index 0); None if it never ran
    reason: str = ""


class Cluster:
    """One namespace of a cluster, through the `kubernetes` client's typed APIs (plain dict bodies)."""

    def __init__(self, api_client: Any, namespace: str, poll_s: float = 1.0) -> None:
        self.namespace = namespace
        self.poll_s = poll_s
        self.core = client.CoreV1Api(api_client)
        self._apis = {"core": self.core, "apps": client.AppsV1Api(api_client),
                      "batch": client.BatchV1Api(api_client)}

    @classmethod
    def connect(cls, namespace: str, kubeconfig: str | None = None, poll_s: float = 1.0) -> Cluster:
        """In a pod (no kubeconfig): the service account's in-cluster config; else the kubeconfig file."""
        cfg = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        else:
            config.load_incluster_config(client_configuration=cfg)
        return cls(client.ApiClient(cfg), namespace, poll_s)

    def _call(self, verb: str, kind: str) -> Callable[..., Any]:
        if kind not in _KINDS:
            raise ClusterError(f"{kind}: not a kind Factory creates ({', '.join(_KINDS)})")
        group, suffix = _KINDS[kind]
        return getattr(self._apis[group], f"{verb}_namespaced_{suffix}")

    def apply(self, obj: m.Manifest) -> None:
        """Create `obj`; if it exists, replace a ConfigMap, or delete and recreate anything else."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            self._call("create", kind)(self.namespace, obj)
            return
        except ApiException as e:
            if e.status != 409:
                raise ClusterError(f"{kind} {name}: the API server refused it ({e.status}): {_reason(e)}") from None
        if kind == "ConfigMap":
            self._call("replace", kind)(name, self.namespace, obj)
            return
        self.delete(obj, wait_s=120.0)
        self._call("create", kind)(self.namespace, obj)

    def delete(self, obj: m.Manifest, wait_s: float = 0.0) -> None:
        """Delete `obj` (and a Job's pods); a missing object is fine. With `wait_s`, wait until it is gone."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            self._call("delete", kind)(name, self.namespace, body={"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status != 404:
                raise ClusterError(f"{kind} {name}: delete refused ({e.status}): {_reason(e)}") from None
            return
        self._until(lambda: self._read(kind, name) is None, wait_s, f"{kind} {name} to be deleted")

    def _read(self, kind: str, name: str) -> Any:
        try:
            return self._call("read", kind)(name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _until(self, done: Callable[[], Any], timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = done()
            if value:
                return value
            if time.monotonic() >= deadline:
                if timeout_s <= 0:
                    return value
                raise ClusterError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(self.poll_s)

    def wait_ready(self, deployments: list[str], timeout_s: float) -> None:
        """Wait until every Deployment has all its replicas ready; the error names those that are not."""
        pending = list(deployments)

        def ready() -> bool:
            nonlocal pending
            reads = {name: self._read("Deployment", name) for name in pending}
            pending = [n for n, d in reads.items()
                       if d is None or (d.status.ready_replicas or 0) < (d.spec.replicas or 1)]
            return not pending

        try:
            self._until(ready, timeout_s, "the rollout servers to be ready")
        except ClusterError as e:
            raise ClusterError(f"{e}; not ready: {', '.join(pending)}") from None

    def pod_of(self, job: str, index: int = 0) -> Any | None:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={job}").items
        for pod in pods:
            if (pod.metadata.labels or {}).get("batch.kubernetes.io/job-completion-index") == str(index):
                return pod
        return None

    def wait_started(self, job: str, index: int, timeout_s: float) -> str:
        """The name of the Job's pod `index` once it runs (or already finished): its log can be followed."""
        def started() -> str | None:
            pod = self.pod_of(job, index)
            return pod.metadata.name if pod is not None and pod.status.phase != "Pending" else None

        return self._until(started, timeout_s, f"pod {index} of Job {job} to start")

    def wait_finished(self, job: str, timeout_s: float) -> JobOutcome:
        """Wait for the Job's Complete or Failed condition; rank 0's exit code comes from its pod."""
        def condition() -> tuple[str, str] | None:
            j = self._read("Job", job)
            if j is None:
                raise ClusterError(f"Job {job} disappeared while it ran")
            for c in j.status.conditions or []:
                if c.type in ("Complete", "Failed") and c.status == "True":
                    return c.type, c.message or c.reason or ""
            return None

        kind, reason = self._until(condition, timeout_s, f"Job {job} to finish")
        pod = self.pod_of(job, 0)
        code = None
        for cs in (pod.status.container_statuses or []) if pod is not None else []:
            if cs.state and cs.state.terminated is not None:
                code = cs.state.terminated.exit_code
        return JobOutcome(succeeded=kind == "Complete", exit_code=code, reason=reason)

    @contextmanager
    def created(self, objs: list[m.Manifest]) -> Iterator[None]:
        """`objs` applied in order, then deleted in reverse order when the block ends, however it ends."""
        done: list[m.Manifest] = []
        try:
            for obj in objs:
                self.apply(obj)
                done.append(obj)
            yield
        finally:
            for obj in reversed(done):
                try:
                    self.delete(obj)
                except Exception:  # noqa: BLE001 - a failed cleanup must not hide the run's own error
                    pass


def _reason(e: Any) -> str:
    try:
        return json.loads(e.body).get("message", e.reason)
    except (TypeError, ValueError, AttributeError):
        return str(e.reason)


@dataclass(frozen=True)
class RunObjects:
    """What one RL run creates: services (ConfigMap, sandbox, rollout servers) before the trainers, then the
    trainers' headless Service and Indexed Job."""

    services: list[m.Manifest]
    deployments: list[str]  # the ones to wait for
    train_service: m.Manifest
    train_job: m.Manifest

    @property
    def job_name(self) -> str:
        return self.train_job["metadata"]["name"]


def run_objects(spec: ExperimentSpec, profile: DeployProfile, env: dict[str, str]) -> RunObjects:
    """The objects of one RL run, the trainer containers given `env` (the Pipes bootstrap variables)."""
    services = [m.spec_configmap(spec, profile), *m.sandbox(spec, profile), *m.rollout(spec, profile)]
    train_service, job = m.training(spec, profile, command=TRAIN_COMMAND)
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [*container["env"], *({"name": k, "value": v} for k, v in sorted(env.items()))]
    return RunObjects(services=services, deployments=[o["metadata"]["name"] for o in services
                                                       if o["kind"] == "Deployment"],
                       train_service=train_service, train_job=job)


def launch_run(cluster: Cluster, objs: RunObjects, follow_rank0: Callable[[str], None],
                ready_timeout_s: float, run_timeout_s: float, log: Log = _log.info) -> JobOutcome:
    """Create the run's services and wait until they are ready, run the trainer Job, follow rank 0's log with
    `follow_rank0(pod_name)` (returns when the log ends), and return how the Job ended. Everything created is
    deleted before returning."""
    with cluster.created(objs.services):
        if objs.deployments:
            log(f"waiting for {len(objs.deployments)} Deployment(s) to be ready: {', '.join(objs.deployments)}")
            cluster.wait_ready(objs.deployments, ready_timeout_s)
        with cluster.created([objs.train_service, objs.train_job]):
            pods = objs.train_job["spec"]["parallelism"]
            log(f"Job {objs.job_name}: {pods} trainer pod(s) in namespace {cluster.namespace}")
            pod = cluster.wait_started(objs.job_name, 0, ready_timeout_s)
            follow_rank0(pod)
            return cluster.wait_finished(objs.job_name, run_timeout_s)
