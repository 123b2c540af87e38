"""The Kubernetes objects a spec needs, as plain dicts (camelCase, as `kubectl apply` reads them).

- the spec itself as a ConfigMap, mounted at /etc/factory/spec.yaml in every Factory pod;
- training: an Indexed Job (`completionMode: Indexed`, parallelism = completions = pods) whose pods each run
  torchrun with nnodes = pods, nproc-per-node = GPUs per pod, node-rank = the pod's completion index, rank 0's
  pod reached through a headless Service (pod hostname `<job>-0`, subdomain the Service). Chosen over a JobSet:
  an Indexed Job is core `batch/v1` (no JobSet controller/CRD to install, and dagster-k8s's `execute_k8s_job`
  can launch it as is); what it lacks is JobSet's restart of the whole group when one pod fails, so the Job has
  backoffLimit 0 and Factory's own resume is the restart;
- rollout: per SGLang server a Deployment (1 replica, tp_size GPUs) + Service. One Service per server instead
  of one Deployment of `servers` replicas behind one Service: the trainer's router (core/sglang/router.py)
  tracks load per server URL and pushes weights to each, which a load-balanced Service address would hide;
  the training pods get the Service URLs as `rollout.sglang.urls`, and weights reach the servers over HTTP
  (`weight_update: tensor`; the other two modes assume one machine and are refused);
- the sandbox pool (code tasks, python_tool): a Deployment + Service running `factory sandbox-serve` under a
  restrictive securityContext; its isolation inside the pod is `none`, because bubblewrap needs user
  namespaces that RuntimeDefault seccomp and dropped capabilities deny; the pod is the boundary;
- `dagster-k8s/config` tags per asset group, and the step Jobs dagster-k8s itself builds from them
  (`dagster_k8s.job.construct_dagster_k8s_job`, as its k8s_job_executor does), serialized by the kubernetes
  client. Their args are a placeholder: dagster fills in the serialized step per run.

Nothing here applies them; admission, scheduling, DNS and NCCL over the Service are unproven (docs/kubernetes.md).
"""

from __future__ import annotations

import json
import re
from typing import Any

from factory.config import ExperimentSpec, apply_overrides
from factory.core.sglang.servers import launch_command
from factory.deploy.profile import DeployProfile, RoleProfile

SPEC_MOUNT = "/etc/factory"
DATA_MOUNT = "/data"
DAGSTER_CONFIG_TAG = "dagster-k8s/config"
# The kinds of step pod (deploy/target.py maps each asset to one): training steps that train in their own process
# (GPUs), the launcher step of the GRPO run (CPU: it starts and watches the trainer pods), and CPU steps.
STEP_ROLES = ("training", "launcher", "evals", "sweeps", "data")
RUN = "run"  # the run-level tags: the run worker pod the K8sRunLauncher starts (orchestrates; CPU)
_PLACEHOLDER = "<serialized {}: filled in by dagster-k8s per run>"

Manifest = dict[str, Any]


def run_name(spec: ExperimentSpec) -> str:
    """A DNS-1123 name for the spec's objects: its name, lowercased, other characters as '-', at most 30."""
    name = re.sub(r"[^a-z0-9-]+", "-", spec.name.lower()).strip("-")[:30].strip("-")
    return name or "factory"


def needs_sandbox(spec: ExperimentSpec) -> bool:
    """Whether the run executes generated code (code rewards or the python tool)."""
    return spec.task.name == "code" or spec.task.environment == "python_tool"


def train_layout(spec: ExperimentSpec, profile: DeployProfile) -> tuple[int, int]:
    """(pods, GPUs per pod) for the trainer's `world_size` ranks; ranks per pod = GPUs per pod (0: one CPU pod)."""
    world, per_pod = spec.trainer.world_size, profile.gpus_per_train_pod
    if per_pod == 0:
        return 1, 0
    if world <= per_pod:
        return 1, world
    if world % per_pod:
        raise ValueError(f"trainer.world_size: {world} ranks do not fill pods of gpus_per_train_pod = {per_pod} "
                         f"GPUs (deploy profile); use a multiple of {per_pod}")
    return world // per_pod, per_pod


def _meta(name: str, profile: DeployProfile, spec: ExperimentSpec, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": profile.namespace, "labels": _labels(spec, component)}


def _labels(spec: ExperimentSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "factory", "app.kubernetes.io/instance": run_name(spec),
            "app.kubernetes.io/component": component}


def _resources(role: RoleProfile, gpus: int, gpu_resource: str) -> dict[str, Any]:
    # Extended resources (GPUs) must have requests == limits; CPU/memory the same, for Guaranteed QoS.
    amounts: dict[str, str] = {"cpu": role.cpu, "memory": role.memory}
    if gpus:
        amounts[gpu_resource] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _placement(role: RoleProfile) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if role.node_selector:
        out["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        out["tolerations"] = [t.manifest() for t in role.tolerations]
    return out


def _volumes(spec: ExperimentSpec, profile: DeployProfile, shm: bool) -> tuple[list[dict], list[dict]]:
    data = ({"persistentVolumeClaim": {"claimName": profile.checkpoint_pvc}} if profile.checkpoint_pvc
            else {"emptyDir": {}})
    volumes = [{"name": "spec", "configMap": {"name": f"{run_name(spec)}-spec"}}, {"name": "data", **data}]
    mounts = [{"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True}, {"name": "data", "mountPath": DATA_MOUNT}]
    if shm:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def rollout_urls(spec: ExperimentSpec, profile: DeployProfile) -> list[str]:
    sg = spec.rollout.sglang
    if spec.rollout.engine != "sglang" or sg is None or sg.urls:
        return []
    return [f"http://{run_name(spec)}-sglang-{i}.{profile.namespace}.svc:{sg.base_port}" for i in range(sg.servers)]


def pod_spec(spec: ExperimentSpec, profile: DeployProfile) -> ExperimentSpec:
    """The spec as the cluster's pods run it: the rendered rollout servers as `rollout.sglang.urls`."""
    urls = rollout_urls(spec, profile)
    return apply_overrides(spec, {"rollout.sglang.urls": urls}) if urls else spec


def spec_configmap(spec: ExperimentSpec, profile: DeployProfile) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{run_name(spec)}-spec", profile, spec, "spec"),
            "data": {"spec.yaml": pod_spec(spec, profile).to_yaml()}}


def env_from(profile: DeployProfile) -> dict[str, Any]:
    """A container's `envFrom` of the profile's env Secret (none without one). Optional: a cluster without the
    Secret runs on the local defaults instead of failing to start the pod."""
    return {"envFrom": [{"secretRef": {"name": profile.env_secret, "optional": True}}]} if profile.env_secret else {}


def _factory_env(spec: ExperimentSpec, profile: DeployProfile) -> list[dict[str, Any]]:
    env = [{"name": "FACTORY_HOME", "value": f"{DATA_MOUNT}/factory"},
           {"name": "OMP_NUM_THREADS", "value": str(spec.trainer.threads or 1)},
           # the preflight gate looks up the node's results by node name (`factory deploy preflight` records them
           # under it); a pod's hostname is the pod's name
           {"name": "FACTORY_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    if needs_sandbox(spec):
        env.append({"name": "FACTORY_SANDBOX_URL",
                    "value": f"http://{run_name(spec)}-sandbox.{profile.namespace}.svc:{profile.sandbox_port}"})
    return env


def training(spec: ExperimentSpec, profile: DeployProfile, command: str = "run") -> tuple[Manifest, Manifest]:
    """(headless Service, Indexed Job) of the trainer ranks, each running `factory <command> SPEC`: `run` (the
    whole experiment, as `factory deploy render` writes it for GitOps) or `train-grpo` (the GRPO run of the
    `grpo_run` asset, reporting to Dagster through Pipes; deploy/cluster.py launches it)."""
    pods, gpus = train_layout(spec, profile)
    name = f"{run_name(spec)}-train"
    labels = _labels(spec, "train")
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, profile, spec, "train"),
               "spec": {"clusterIP": "None", "selector": labels, "publishNotReadyAddresses": True,
                        "ports": [{"name": "rendezvous", "port": profile.master_port}]}}
    master = f"{name}-0.{name}.{profile.namespace}.svc"  # pod `<job>-<index>` under subdomain `<service>`
    spec_file = f"{SPEC_MOUNT}/spec.yaml"
    if spec.trainer.world_size > 1:
        args = ["python", "-m", "torch.distributed.run", f"--nnodes={pods}",
                f"--nproc-per-node={spec.trainer.world_size // pods}", "--node-rank=$(NODE_RANK)",
                f"--master-addr={master}", f"--master-port={profile.master_port}", "--max-restarts=0",
                "-m", "factory.cli", command, spec_file, *(["--in-process"] if command == "run" else [])]
    else:
        args = ["factory", command, spec_file]
    volumes, mounts = _volumes(spec, profile, shm=True)
    env = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        *_factory_env(spec, profile)]
    container = {"name": "trainer", "image": profile.image, "args": args, "env": env, **env_from(profile),
                 "ports": [{"containerPort": profile.master_port, "name": "rendezvous"}],
                 "resources": _resources(profile.train, gpus, profile.gpu_resource), "volumeMounts": mounts}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(name, profile, spec, "train"),
           "spec": {"completionMode": "Indexed", "completions": pods, "parallelism": pods, "backoffLimit": 0,
                    "template": {"metadata": {"labels": labels},
                                 "spec": {"subdomain": name, "restartPolicy": "Never", "containers": [container],
                                          "volumes": volumes, **_placement(profile.train)}}}}
    return service, job


def rollout(spec: ExperimentSpec, profile: DeployProfile) -> list[Manifest]:
    """Per SGLang server: a Deployment (1 replica, tp_size GPUs) and its Service. None unless the spec starts
    SGLang servers (rollout.engine: sglang without urls)."""
    sg = spec.rollout.sglang
    if not rollout_urls(spec, profile):
        return []
    assert sg is not None
    if sg.weight_update != "tensor":
        # disk: the safetensors go to the trainer pod's temp directory; distributed: the group's address is
        # 127.0.0.1 (core/sglang/producer.py). Neither reaches a server in another pod.
        raise ValueError(f"rollout.sglang.weight_update: the servers run in their own pods, which only 'tensor' "
                         f"(weights over HTTP) reaches, got {sg.weight_update!r}")
    out: list[Manifest] = []
    for i in range(sg.servers):
        name = f"{run_name(spec)}-sglang-{i}"
        labels = {**_labels(spec, "rollout"), "factory/server": str(i)}
        # Server 0's command (port base_port, GPUs from 0 of the pod's own), listening on the pod's address.
        argv = launch_command(sg, profile.model_path, 0, python=sg.python or "python3", placed=True)
        argv[argv.index("--host") + 1] = "0.0.0.0"  # noqa: S104 - the Service reaches it on the pod IP
        volumes, mounts = _volumes(spec, profile, shm=True)
        container = {"name": "sglang", "image": profile.rollout_image or profile.image, "command": argv,
                     "ports": [{"containerPort": sg.base_port, "name": "http"}],
                     "readinessProbe": {"httpGet": {"path": "/health", "port": sg.base_port},
                                        "periodSeconds": 10, "failureThreshold": 3},
                     "resources": _resources(profile.rollout, sg.tp_size, profile.gpu_resource),
                     "volumeMounts": mounts}
        meta = {**_meta(name, profile, spec, "rollout"), "labels": labels}
        out.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
                    "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                             "template": {"metadata": {"labels": labels},
                                          "spec": {"containers": [container], "volumes": volumes,
                                                   **_placement(profile.rollout)}}}})
        out.append({"apiVersion": "v1", "kind": "Service", "metadata": meta,
                    "spec": {"selector": labels, "ports": [{"name": "http", "port": sg.base_port,
                                                            "targetPort": sg.base_port}]}})
    return out


RESTRICTED_CONTAINER = {"runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def sandbox(spec: ExperimentSpec, profile: DeployProfile) -> list[Manifest]:
    """The sandbox pool (Deployment + Service) when the run executes generated code, else nothing."""
    if not needs_sandbox(spec):
        return []
    name = f"{run_name(spec)}-sandbox"
    labels = _labels(spec, "sandbox")
    argv = ["factory", "sandbox-serve", "--host", "0.0.0.0", "--port", str(profile.sandbox_port),  # noqa: S104
            "--size", str(spec.task.sandbox_workers), "--isolation", "none"]
    container = {"name": "sandbox", "image": profile.image, "args": argv,
                 "ports": [{"containerPort": profile.sandbox_port, "name": "http"}],
                 "resources": _resources(profile.sandbox, 0, profile.gpu_resource),
                 "securityContext": RESTRICTED_CONTAINER,
                 "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}
    pod = {"automountServiceAccountToken": False, "enableServiceLinks": False,
           "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                               "seccompProfile": {"type": "RuntimeDefault"}},
           "containers": [container], "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
           **_placement(profile.sandbox)}
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, profile, spec, "sandbox"),
             "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels}, "spec": pod}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name, profile, spec, "sandbox"),
             "spec": {"selector": labels, "ports": [{"name": "http", "port": profile.sandbox_port}]}}]


# What grpo_run's step pod creates, watches and deletes per run (deploy/cluster.py), and nothing else.
LAUNCHER_RULES = [
    {"apiGroups": [""], "resources": ["configmaps", "services"], "verbs": ["get", "create", "update", "delete"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "create", "delete"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "create", "delete"]},
    {"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list"]},
]


def launcher_rbac(spec: ExperimentSpec, profile: DeployProfile) -> tuple[Manifest, Manifest]:
    """(Role, RoleBinding) letting Dagster's pods launch a run's objects in the namespace (LAUNCHER_RULES)."""
    name = "factory-launcher"
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": _meta(name, profile, spec, "launcher"), "rules": LAUNCHER_RULES}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": _meta(name, profile, spec, "launcher"),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": profile.launcher_service_account,
                             "namespace": profile.namespace}]}
    return role, binding


def dagster_tags(spec: ExperimentSpec, profile: DeployProfile) -> dict[str, dict[str, str]]:
    """Per step role (STEP_ROLES; deploy/target.py says which asset has which), the op tags for dagster-k8s
    (`{"dagster-k8s/config": json}`): training gets the GPUs of one training pod, shared memory and the train node
    pool; the launcher, evals, sweeps and data get the eval role (CPU); and under `run`, the run's own tags (its
    run worker pod: the eval role, CPU)."""
    _, gpus = train_layout(spec, profile)
    volumes, mounts = _volumes(spec, profile, shm=True)
    out: dict[str, dict[str, str]] = {}
    for group in (RUN, *STEP_ROLES):
        role, g = (profile.train, gpus) if group == "training" else (profile.eval, 0)
        vols, mnts = (volumes, mounts) if group == "training" else (volumes[:2], mounts[:2])
        config = {"container_config": {"resources": _resources(role, g, profile.gpu_resource),
                                       "env": _factory_env(spec, profile), "volume_mounts": mnts,
                                       **env_from(profile)},  # dagster-k8s takes camelCase keys too
                  "pod_spec_config": {"volumes": vols, **_placement(role)}}
        out[group] = {DAGSTER_CONFIG_TAG: json.dumps(config, sort_keys=True)}
    return out


def tags_configmap(spec: ExperimentSpec, tags: dict[str, dict[str, str]], profile: DeployProfile) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(f"{run_name(spec)}-dagster-tags", profile, spec, "dagster"),
            "data": {f"{group}.json": t[DAGSTER_CONFIG_TAG] for group, t in tags.items()}}


def dagster_job(spec: ExperimentSpec, profile: DeployProfile, group: str, tags: dict[str, str]) -> Manifest:
    """The Job dagster-k8s would create for `tags`: for an asset group, the step Job of its k8s_job_executor; for
    `run`, the run worker Job of its K8sRunLauncher. Built by dagster-k8s's own functions (the tags parsed and
    checked by `get_user_defined_k8s_config`, the Job by `construct_dagster_k8s_job`)."""
    # only the run worker Job needs dagster-k8s and kubernetes, not the other manifests
    from dagster_k8s.job import (  # noqa: PLC0415 heavy: dagster-k8s, kubernetes; the run worker Job only
        DagsterK8sJobConfig,
        construct_dagster_k8s_job,
        get_user_defined_k8s_config,
    )
    from kubernetes.client import ApiClient  # noqa: PLC0415 heavy: kubernetes; the run worker Job only

    job_config = DagsterK8sJobConfig(job_image=profile.image, image_pull_policy="IfNotPresent",
                                     dagster_home="/opt/dagster/dagster_home",
                                     instance_config_map="dagster-instance",
                                     postgres_password_secret="dagster-postgresql-secret")
    if group == RUN:
        name, component, labels = f"dagster-run-{run_name(spec)}", "run_worker", {"dagster/job": "factory"}
        args = ["dagster", "api", "execute_run", _PLACEHOLDER.format("run")]
    else:
        name, component = f"dagster-step-{run_name(spec)}-{group}", "step_worker"
        labels = {"dagster/job": "factory", "dagster/op": group}
        args = ["dagster", "api", "execute_step", _PLACEHOLDER.format("step")]
    job = construct_dagster_k8s_job(job_config, args, name, get_user_defined_k8s_config(tags), pod_name=name,
                                    component=component, labels=labels)
    manifest = ApiClient().sanitize_for_serialization(job)
    manifest["metadata"]["namespace"] = profile.namespace
    return manifest
