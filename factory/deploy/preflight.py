"""What a cluster needs to preflight its nodes (`factory deploy preflight --nodes n1,n2 --out DIR`): RBAC that lets
the preflight pod read and patch Node objects, and one Job per node running `factory preflight --mark-node`, which
labels, taints and annotates its node with the outcome (factory/ops/preflight/mark.py).

One Job per node, not a DaemonSet: the preflight must see the GPUs a training pod gets, so its pod requests them;
a DaemonSet pod is restarted whenever it exits and so would hold every GPU of every node for good, blocking the
training it tests for. A Job finishes and frees them. The cost is that a Job names its node, so the node list is
an input (`--nodes`, e.g. from `kubectl get nodes -l <train pool> -o name`); nodes added later need a new render.

Each Job's pod is pinned with a required node affinity on the field `metadata.name` (what the DaemonSet controller
itself uses), not `nodeName` (which bypasses the scheduler: the pod would be sent to a node whose GPUs are taken and
fail there instead of waiting) nor the `kubernetes.io/hostname` label (not always the node's name). It carries the
train role's tolerations and CPU/memory from the deploy profile, its data volume (the checkpoint PVC at /data,
FACTORY_HOME on it, so the disk checks test what training writes to and the results land in the run's lake) and
shared memory, and the profile's env Secret (so the lake and MLflow checks test the services training uses); with a
spec, the spec ConfigMap too.

GPUs: a training pod's by default (the spec's layout, else the profile's gpus_per_train_pod), or `--gpus-per-node`,
a node's whole count, so that every GPU is tested where training pods share a node (which GPUs a smaller request
gets is the device plugin's choice). The pod is told how many it asked for (FACTORY_EXPECTED_GPUS), so a pod with 4
of a node's 8 GPUs is held to the 4-GPU kind's floors and count (ops/preflight/nodes.py: 1, 2, 4 or 8; other
counts are refused here, naming the flag or field).

It also tolerates the preflight-failed taint (so a failed node is re-tested and cleared) and the cordon taint
`node.kubernetes.io/unschedulable` (so a node cordoned for repair can be preflighted before it is uncordoned). The
train role's node selector is not copied: the node is named, and a selector that missed it would leave the pod
Pending. The node name reaches the pod through the downward API (spec.nodeName) as NODE_NAME and FACTORY_NODE, so
`node_health` rows are keyed by the node, not the pod.

Not run against a real API server (docs/kubernetes.md); scheduling, RBAC admission and the patch's effect on a real
scheduler are unproven (the manifests are checked against the Kubernetes schemas in tests/deploy).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from factory.config import ExperimentSpec
from factory.deploy import manifests as m
from factory.deploy.profile import DeployProfile
from factory.deploy.render import RenderError
from factory.ops.preflight.mark import TAINT_EFFECT, TAINT_KEY, tolerates
from factory.ops.preflight.nodes import GPU_COUNTS

NAME = "factory-preflight"
COMPONENT = "preflight"
NODE_ANNOTATION = "factory.dev/node"
POD_DEADLINE_S = 1800  # a hung preflight gives its node's GPUs back after this long
TTL_AFTER_FINISHED_S = 86400  # the finished Job (and its pod's log) is kept a day; the outcome stays on the node
CORDON_TAINT = "node.kubernetes.io/unschedulable"
# A node name is a DNS subdomain: lowercase alphanumerics, '-' and '.', at most 253 characters.
_NODE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_JOB_NAME_MAX = 63  # the Job controller copies the name into a label value


def parse_nodes(text: str) -> list[str]:
    """The node names in a comma-separated `--nodes` value; RenderError naming `--nodes` for an empty list, a name
    that is not a valid node name, or a duplicate."""
    nodes = [n.strip() for n in text.split(",") if n.strip()]
    if not nodes:
        raise RenderError("--nodes: no node names given (comma-separated, e.g. --nodes gpu-node-1,gpu-node-2)")
    bad = [n for n in nodes if len(n) > 253 or not _NODE.match(n)]
    if bad:
        raise RenderError(f"--nodes: not a Kubernetes node name (lowercase letters, digits, '-', '.'): "
                          f"{', '.join(map(repr, bad))}")
    dupes = sorted({n for n in nodes if nodes.count(n) > 1})
    if dupes:
        raise RenderError(f"--nodes: listed more than once: {', '.join(dupes)}")
    return nodes


def job_name(node: str) -> str:
    """`factory-preflight-<node>` as a DNS label; a node name that had to be changed (dots, length) gets a hash of
    the name appended, so two nodes never share a Job."""
    base = f"{NAME}-{node}"
    clean = re.sub(r"[^a-z0-9-]+", "-", base)
    if clean == base and len(base) <= _JOB_NAME_MAX:
        return base
    digest = hashlib.sha256(node.encode()).hexdigest()[:8]
    return f"{clean[:_JOB_NAME_MAX - 9].rstrip('-')}-{digest}"


def _labels() -> dict[str, str]:
    return {"app.kubernetes.io/name": "factory", "app.kubernetes.io/component": COMPONENT}


def _meta(name: str, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": _labels()}
    if namespace is not None:
        meta["namespace"] = namespace
    return meta


def rbac(profile: DeployProfile) -> dict[str, m.Manifest]:
    """The ServiceAccount the preflight pods run as, and a ClusterRole (Nodes are cluster-scoped) granting get and
    patch on nodes only, bound to it."""
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(NAME, profile.namespace)}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": _meta(NAME),
            "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": _meta(NAME),
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
               "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": profile.namespace}]}
    return {"preflight-serviceaccount.yaml": account, "preflight-clusterrole.yaml": role,
            "preflight-clusterrolebinding.yaml": binding}


def _volumes(profile: DeployProfile, spec: ExperimentSpec | None) -> tuple[list[dict], list[dict]]:
    # As the training pods have them (manifests._volumes), the spec ConfigMap only when a spec is given.
    data = ({"persistentVolumeClaim": {"claimName": profile.checkpoint_pvc}} if profile.checkpoint_pvc
            else {"emptyDir": {}})
    volumes: list[dict] = [{"name": "data", **data},
                           {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.shm_size}}]
    mounts: list[dict] = [{"name": "data", "mountPath": m.DATA_MOUNT}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if spec is not None:
        volumes.insert(0, {"name": "spec", "configMap": {"name": f"{m.run_name(spec)}-spec"}})
        mounts.insert(0, {"name": "spec", "mountPath": m.SPEC_MOUNT, "readOnly": True})
    return volumes, mounts


def tolerations(profile: DeployProfile) -> list[dict[str, str]]:
    """The train role's tolerations, then the preflight-failed taint's and the cordon's (unless already there)."""
    out = [t.manifest() for t in profile.train.tolerations]
    for key in (TAINT_KEY, CORDON_TAINT):
        extra = {"key": key, "operator": "Exists", "effect": TAINT_EFFECT}
        if extra not in out:
            out.append(extra)
    return out


def job_gpus(profile: DeployProfile, spec: ExperimentSpec | None = None, gpus: int | None = None) -> int:
    """The GPUs a preflight pod requests: `gpus` when given (a node's whole count, so every GPU is tested), else a
    training pod's (the spec's layout, else the profile's gpus_per_train_pod). RenderError for a negative count."""
    if gpus is not None:
        where = "--gpus-per-node"
    elif spec is not None:
        gpus, where = m.train_layout(spec, profile)[1], "GPUs per training pod (trainer.world_size, gpus_per_train_pod)"
    else:
        gpus, where = profile.gpus_per_train_pod, "gpus_per_train_pod"
    if gpus not in (0, *GPU_COUNTS):
        raise RenderError(f"{where}: a preflight pod holds 0, 1, 2, 4 or 8 GPUs (the node kinds the checks know), "
                          f"got {gpus}")
    return gpus


def node_job(node: str, profile: DeployProfile, spec: ExperimentSpec | None = None, deep: bool = False,
             gpus: int | None = None) -> m.Manifest:
    """The Job that preflights `node` and marks it (see the module docstring); `gpus` as in `job_gpus`."""
    gpus = job_gpus(profile, spec, gpus)
    amounts: dict[str, str] = {"cpu": profile.train.cpu, "memory": profile.train.memory}
    if gpus:
        amounts[profile.gpu_resource] = str(gpus)
    volumes, mounts = _volumes(profile, spec)
    env = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "FACTORY_NODE", "value": "$(NODE_NAME)"},
           {"name": "FACTORY_HOME", "value": f"{m.DATA_MOUNT}/factory"},
           # the GPUs this pod asked for: the count the node kind's floors (and the count check) expect
           *([{"name": "FACTORY_EXPECTED_GPUS", "value": str(gpus)}] if gpus else [])]
    args = ["factory", "preflight", "--mark-node", "--verbose", *(["--deep"] if deep else [])]
    # The Secret of every Factory pod (catalog, MLflow, object store): the lake and MLflow checks test the services
    # training uses, and the results land in the team's lake. Optional, as for the training pods.
    container = {"name": "preflight", "image": profile.image, "args": args, "env": env, **m.env_from(profile),
                 "resources": {"requests": dict(amounts), "limits": dict(amounts)}, "volumeMounts": mounts}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    pod = {"serviceAccountName": NAME, "restartPolicy": "Never", "activeDeadlineSeconds": POD_DEADLINE_S,
           "affinity": affinity, "tolerations": tolerations(profile), "containers": [container], "volumes": volumes}
    meta = {**_meta(job_name(node), profile.namespace), "annotations": {NODE_ANNOTATION: node}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
                     "template": {"metadata": {"labels": _labels(), "annotations": {NODE_ANNOTATION: node}},
                                  "spec": pod}}}


def render_preflight(nodes: list[str], profile: DeployProfile, spec: ExperimentSpec | None = None,
                     deep: bool = False, gpus: int | None = None) -> dict[str, m.Manifest]:
    """{file name: manifest}: the RBAC, then one Job per node, in apply order. RenderError for a spec whose ranks
    do not fill the profile's pods, a negative GPU count, or train tolerations that would let training pods onto a
    failed node (naming the field or flag)."""
    for i, t in enumerate(profile.train.tolerations):
        if tolerates([t.manifest()]):  # then training pods would land on failed nodes: marking them is moot
            raise RenderError(f"train.tolerations.{i}: tolerates the taint {TAINT_KEY} that keeps training off a "
                              f"node that failed its preflight (a toleration with no key and operator Exists "
                              f"tolerates every taint); give the taints the train pool needs by key")
    out = rbac(profile)
    try:
        for node in nodes:
            out[f"preflight-job-{job_name(node)}.yaml"] = node_job(node, profile, spec, deep, gpus)
    except ValueError as e:
        raise RenderError(str(e)) from None
    return out
