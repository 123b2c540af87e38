"""A fake Kubernetes API server for tests: a test double for the API server that cannot run on this machine.

It is a real HTTP server on 127.0.0.1 (stdlib ThreadingHTTPServer in a thread) speaking the subset of the Kubernetes
REST API that Factory's launch code uses, so that code runs unchanged through the official `kubernetes` client (and
dagster-k8s on top of it). Every object created, replaced or patched is validated strictly against the Kubernetes 1.37
schemas (kubernetes-validate, as tests/deploy/test_render.py): an invalid body gets a 422 Status naming the field, as a
real server would, so a launch test fails loudly on a bad manifest.

Resources: ConfigMap, Service, Deployment (apps/v1), Job (batch/v1), Pod (get/list/delete/log: Jobs make them), Node
(cluster scoped, get/list/patch: seed with add_node), Event (list: always empty); ServiceAccount, Role and RoleBinding
are stored and validated, nothing more. Verbs: POST create (409 AlreadyExists; generateName), GET (404 NotFound; also
the /status subresource), list (labelSelector `a=b,c!=d,e,!f`; fieldSelector =/!= on metadata.name/namespace,
status.phase, spec.nodeName), watch (JSON-line events: ADDED for what exists, or every change after a resourceVersion;
until timeoutSeconds), PUT replace (409 Conflict on a stale resourceVersion), DELETE (DeleteOptions in the body or
query), PATCH (merge-patch and json-patch on nodes/configmaps/services/deployments; strategic-merge (the Python client's
default for a dict) on nodes and configmaps only, with merge semantics, which is exact there: maps merged, spec.taints
replaced whole; elsewhere 415), `dryRun=All`. Server-set fields: uid, resourceVersion, creationTimestamp, generation, a
Service's clusterIP, a Job's selector and controller-uid/job-name labels and the defaults the fake acts on (completions,
parallelism, backoffLimit, completionMode). Namespaces are not objects: any name works.

Deployments run nothing: their status says ready (readyReplicas = availableReplicas = replicas, Available=True) unless
`set_ready(name, False)`. Jobs run: for each completion index (Indexed: `parallelism` pods at once; NonIndexed: no
index) a Pod `{job}-{index}-{5 chars}` (NonIndexed `{job}-{5 chars}`) with the template's labels plus job-name,
controller-uid and the completion-index label and annotation, spec.hostname `{job}-{index}`, and a node, round robin
over the seeded nodes whose labels match the nodeSelector and whose NoSchedule/NoExecute taints are tolerated
("fake-node" if none was seeded; Pending and Unschedulable if none fits). Its first container runs as a local process
(tests/deploy/fake_kubelet.py: env, $(VAR) expansion, path_map, ConfigMap volumes, JOB_COMPLETION_INDEX). Pods go
Pending -> Running -> Succeeded/Failed with the exit code (StartError, 128, with the reason if it cannot start); Jobs
get active/ready/succeeded/failed, completedIndexes, startTime/completionTime and SuccessCriteriaMet+Complete or
FailureTarget+Failed (BackoffLimitExceeded once failed pods > backoffLimit, a failed index being retried with a new pod
until then; DeadlineExceeded after activeDeadlineSeconds); a failed Job's remaining processes are killed. Deleting a
Job with propagationPolicy Background/Foreground deletes its pods and kills their processes (SIGTERM, then SIGKILL);
with none or Orphan (batch/v1's default, with the API server's Warning header) they stay, as on a real cluster.
Pod logs (stdout+stderr merged): follow (chunked, ends when the process does), timestamps (fixed-width RFC3339Nano UTC,
strictly increasing), container, sinceSeconds, tailLines; 400 "waiting to start" before the container runs, like the
kubelet; limitBytes ignored; previous is always 400 (nothing restarts).

Not emulated: real containers or images (without `command`, a container runs `entrypoints[image]` + args, the test
saying what the image's ENTRYPOINT is; only the first container of a pod runs), scheduling beyond the above (no
resources, affinity, preemption; an unschedulable pod is never retried), admission and defaulting beyond the fields
acted on, RBAC/auth/TLS, restarts (restartPolicy OnFailure acts like Never), Pods of Deployments, Services' networking
and cluster DNS (`hosts` rewrites names instead), Secrets, finalizers, Events, server-side apply, podFailurePolicy/
backoffLimitPerIndex/successPolicy/suspend/manualSelector (422 "fake_kube: ... is not emulated").

Fixture API (tests/deploy/conftest.py: `fake_kube`, a FakeKube on a free port whose pods run in tmp_path/fake-kube;
at teardown every pod process is killed, the server stopped, and the test fails if the fake itself raised):
    fake.host: str; fake.api_client() -> kubernetes.client.ApiClient; fake.write_kubeconfig(path) -> Path
    fake.path_map: dict[str, str]      # container path prefix -> local dir, set before the Job is created;
                                       # rewrites command, args, env values: pick prefixes no local path starts with
    fake.hosts: dict[str, str]         # cluster DNS name -> local address, rewritten in args and env values alike
    fake.entrypoints: dict[str, list[str]]  # image (or "*") -> its ENTRYPOINT, for containers without a command
    fake.extra_env: dict[str, str]     # added to every pod process's env, last (wins over the container's)
    fake.process_timeout: float = 600  # seconds a pod process may run before it is killed (a hang guard)
    fake.add_node(name, labels=None, taints=None, allocatable=None) -> dict; fake.node(name) -> dict
    fake.get(kind, name, namespace="default") -> dict | None; fake.list(kind, namespace=None, labels=None) -> list[dict]
    fake.set_ready(name, ready=True, namespace="default") -> None   # a Deployment's readiness, before or after create
    fake.wait(predicate, timeout=10.0, what="") -> None            # bounded wait, re-checked on every state change
    fake.wait_job(name, namespace="default", timeout=20.0) -> dict # the Job once Complete or Failed
    fake.runs: list[PodRun]; fake.run_of(pod, namespace="default") -> PodRun  # argv, env, cwd, returncode, output()
    fake.requests: list[Request]  # method, path, query: dict[str, str], body (parsed JSON), content_type
    fake.errors: list[str]        # tracebacks of the fake's own failures (500s, crashed threads)
"""

from __future__ import annotations

import copy
import json
import random
import re
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import kubernetes
import kubernetes_validate
import yaml

from tests.deploy import fake_kubelet
from tests.deploy.fake_kubelet import Machine, PodRun, StartError

K8S_VERSION = "1.37.0"  # the schemas tests/deploy/test_render.py validates against
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # Kubernetes' own name-suffix alphabet
_INDEX = "batch.kubernetes.io/job-completion-index"
_ORPHAN_WARNING = ('299 - "child pods are preserved by default when jobs are deleted; set propagationPolicy=Background '
                   'to remove them or set propagationPolicy=Orphan to suppress this warning"')


@dataclass(frozen=True)
class _Resource:
    kind: str
    api_version: str
    plural: str
    namespaced: bool
    verbs: frozenset[str]


_ALL = frozenset({"create", "get", "list", "replace", "delete", "patch"})
_RESOURCES = {r.plural: r for r in (
    _Resource("ConfigMap", "v1", "configmaps", True, _ALL),
    _Resource("Service", "v1", "services", True, _ALL),
    _Resource("Pod", "v1", "pods", True, frozenset({"get", "list", "delete"})),
    _Resource("Node", "v1", "nodes", False, frozenset({"get", "list", "patch"})),
    _Resource("Event", "v1", "events", True, frozenset({"list"})),  # always empty: nothing records events
    _Resource("Deployment", "apps/v1", "deployments", True, _ALL),
    _Resource("Job", "batch/v1", "jobs", True, _ALL - {"patch"}),
    _Resource("ServiceAccount", "v1", "serviceaccounts", True, _ALL - {"patch"}),  # stored, validated; no behaviour
    _Resource("Role", "rbac.authorization.k8s.io/v1", "roles", True, _ALL - {"patch"}),
    _Resource("RoleBinding", "rbac.authorization.k8s.io/v1", "rolebindings", True, _ALL - {"patch"}),
)}
_BY_KIND = {r.kind: r for r in _RESOURCES.values()}
_PATH = re.compile(r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>log|status))?$")


class ApiError(Exception):
    """An error answered as a Kubernetes Status object."""

    def __init__(self, code: int, reason: str, message: str, causes: list[dict] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.causes = code, reason, message, causes or []

    def status(self) -> dict:
        details = {"causes": self.causes} if self.causes else {}
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message,
                "reason": self.reason, "details": details, "code": self.code}


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any
    content_type: str | None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _selector(text: str | None) -> Callable[[dict], bool]:
    terms = []
    for term in filter(None, (t.strip() for t in (text or "").split(","))):
        if m := re.fullmatch(r"([^!=\s]+)\s*(==|=|!=)\s*(\S*)", term):
            terms.append((m[1], m[2] != "!=", m[3]))
        elif m := re.fullmatch(r"(!?)([^!=\s]+)", term):
            terms.append((m[2], not m[1], None))
        else:
            raise ApiError(400, "BadRequest", f"fake_kube: unsupported label selector term {term!r}")

    def match(labels: dict) -> bool:
        return all((labels.get(k) == v if v is not None else k in labels) == positive for k, positive, v in terms)
    return match


_FIELDS = {"metadata.name": ("metadata", "name"), "metadata.namespace": ("metadata", "namespace"),
           "status.phase": ("status", "phase"), "spec.nodeName": ("spec", "nodeName"),
           "involvedObject.name": ("involvedObject", "name"), "involvedObject.kind": ("involvedObject", "kind")}


def _field_selector(text: str | None) -> Callable[[dict], bool]:
    checks = []
    for term in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"([\w.]+)(==|=|!=)(.*)", term)
        if not m or m[1] not in _FIELDS:
            raise ApiError(400, "BadRequest", f"fake_kube: unsupported field selector {term!r}")
        checks.append((_FIELDS[m[1]], m[2] != "!=", m[3]))
    return lambda obj: all(((obj.get(a) or {}).get(b) == v) == pos for (a, b), pos, v in checks)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(doc: Any, ops: list) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, test."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        try:
            for p in parts[:-1]:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            last = parts[-1]
            if op["op"] == "test":
                value = parent[int(last)] if isinstance(parent, list) else parent[last]
                if value != op["value"]:
                    raise ApiError(422, "Invalid", f"json patch test failed at {op['path']}")
            elif op["op"] == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif op["op"] in ("add", "replace"):
                value = copy.deepcopy(op["value"])
                if isinstance(parent, list) and op["op"] == "add":
                    parent.insert(len(parent) if last == "-" else int(last), value)
                elif isinstance(parent, list):
                    parent[int(last)] = value
                elif op["op"] == "replace" and last not in parent:
                    raise KeyError(last)
                else:
                    parent[last] = value
            else:
                raise ApiError(415, "UnsupportedMediaType", f"fake_kube: json patch op {op['op']!r} not emulated")
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"json patch {op}: path not found ({e})") from e
    return doc


def _directives(patch: Any) -> bool:
    if isinstance(patch, dict):
        return any(str(k).startswith("$") or _directives(v) for k, v in patch.items())
    return isinstance(patch, list) and any(_directives(v) for v in patch)


def _validate(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(map(str, e.absolute_path)) or "<root>"
        name = obj.get("metadata", {}).get("name")
        raise ApiError(422, "Invalid", f'{obj.get("kind")} "{name}" is invalid: {where}: {e.message}',
                       [{"reason": "FieldValueInvalid", "field": where, "message": e.message}]) from e


def _true(value: str | None) -> bool:
    return value in ("1", "t", "T", "true", "True", "TRUE")  # Go's strconv.ParseBool: the Python client sends "True"


def _suffix() -> str:
    return "".join(random.choices(_SUFFIX_CHARS, k=5))


def _ranges(indexes: set[int]) -> str:
    out: list[list[int]] = []
    for i in sorted(indexes):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


@dataclass
class _Stream:
    """A response written chunked by the handler as its chunks come: followed logs, watches."""

    chunks: Iterator[bytes]
    content_type: str


def _machine_attr(name: str) -> property:
    return property(lambda self: getattr(self.machine, name), lambda self, value: setattr(self.machine, name, value))


class FakeKube:
    """The fake API server; see the module docstring for what it does and does not emulate."""

    workdir, path_map, hosts, entrypoints, extra_env = map(_machine_attr, (
        "workdir", "path_map", "hosts", "entrypoints", "extra_env"))

    # A guard against hung pods, not a speed check: at 60 s, a pod's whole `factory train-grpo` beside other work
    # (load 10 on 2 cores) was killed (137) as it exited, and Dagster's retry of the step started a second pod.
    def __init__(self, workdir: Path, process_timeout: float = 600.0) -> None:
        self.machine = Machine(Path(workdir))
        self.process_timeout = process_timeout
        self.requests: list[Request] = []
        self.errors: list[str] = []
        self.runs: list[PodRun] = []
        self._objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace or "", name) -> object
        self._ready: dict[tuple[str, str], bool] = {}
        self._cond = threading.Condition(threading.RLock())
        self._rv = 0
        self._events: list[tuple[int, str, str, str, dict]] = []  # (resourceVersion, type, plural, ns, object)
        self._ips = 0
        self._rr = 0
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._server = _Server(self)
        self.host = f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- lifecycle and test-facing helpers ---------------------------------------------------------------------------

    def __enter__(self) -> FakeKube:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._spawn(self._server.serve_forever, poll_interval=0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for run in list(self.runs):
            fake_kubelet.kill(run, grace=0.0)
        self._server.shutdown()
        self._server.server_close()
        for sock in list(self._server.connections):  # idle keep-alive connections hold handler threads
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout=10)

    def api_client(self) -> kubernetes.client.ApiClient:
        return kubernetes.client.ApiClient(kubernetes.client.Configuration(host=self.host))

    def write_kubeconfig(self, path: Path) -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.host}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}]}))
        return path

    def add_node(self, name: str, labels: dict[str, str] | None = None, taints: list[dict] | None = None,
                 allocatable: dict[str, str] | None = None) -> dict:
        resources = {"cpu": "16", "memory": "128Gi", "pods": "110", **(allocatable or {})}
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                "spec": {"taints": taints} if taints else {},
                "status": {"capacity": resources, "allocatable": resources, "conditions": [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastTransitionTime": _now()}]}}
        _validate(node)
        with self._cond:
            self._store("nodes", "", node, new=True)
        return self.node(name)

    def node(self, name: str) -> dict:
        obj = self.get("Node", name, namespace="")
        if obj is None:
            raise KeyError(f"no node {name!r}")
        return obj

    def get(self, kind: str, name: str, namespace: str = "default") -> dict | None:
        res = _BY_KIND[kind]
        with self._cond:
            obj = self._objects.get((res.plural, namespace if res.namespaced else "", name))
            return copy.deepcopy(obj) if obj else None

    def list(self, kind: str, namespace: str | None = None, labels: dict[str, str] | None = None) -> list[dict]:
        plural = _BY_KIND[kind].plural
        with self._cond:
            return [copy.deepcopy(o) for (p, ns, _), o in sorted(self._objects.items())
                    if p == plural and namespace in (None, ns)
                    and (labels or {}).items() <= o["metadata"].get("labels", {}).items()]

    def set_ready(self, name: str, ready: bool = True, namespace: str = "default") -> None:
        with self._cond:
            self._ready[(namespace, name)] = ready
            if obj := self._objects.get(("deployments", namespace, name)):
                self._deployment_status(obj)
                self._store("deployments", namespace, obj)

    def wait(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
        with self._cond:
            if not self._cond.wait_for(predicate, timeout=timeout):
                raise TimeoutError(f"fake_kube: not within {timeout}s: {what or predicate}")

    def wait_job(self, name: str, namespace: str = "default", timeout: float = 20.0) -> dict:
        def finished() -> bool:
            job = self._objects.get(("jobs", namespace, name))
            return any(c["type"] in ("Complete", "Failed") for c in (job or {}).get("status", {}).get("conditions", []))
        self.wait(finished, timeout, f"job {namespace}/{name} Complete or Failed")
        return self.get("Job", name, namespace)  # type: ignore[return-value]

    def run_of(self, pod: str, namespace: str = "default") -> PodRun:
        with self._cond:
            return next(r for r in self.runs if (r.namespace, r.pod) == (namespace, pod))

    # -- request handling --------------------------------------------------------------------------------------------

    def dispatch(self, method: str, raw_path: str, raw: bytes, content_type: str | None) -> tuple:
        url = urlsplit(raw_path)
        query = dict(parse_qsl(url.query))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.requests.append(Request(method, url.path, query, body, content_type))
        try:
            if isinstance(body, str):
                raise ApiError(400, "BadRequest", "fake_kube: request body is not JSON")
            return self._route(method, url.path, query, body, content_type or "")
        except ApiError as e:
            return e.code, e.status(), {}
        except Exception:
            self.errors.append(traceback.format_exc())
            return 500, ApiError(500, "InternalError", traceback.format_exc()).status(), {}

    def _route(self, method: str, path: str, query: dict, body: Any, ctype: str) -> tuple:
        m = _PATH.match(path)
        res = _RESOURCES.get(m["plural"]) if m else None
        if not m or not res or res.api_version != (m["core"] or f"{m['group']}/{m['version']}") \
                or (m["ns"] is not None and not res.namespaced) or (m["sub"] == "log" and res.plural != "pods"):
            raise ApiError(404, "NotFound", f"fake_kube: the server could not find the requested resource {path}")
        ns, name = (m["ns"] or "") if res.namespaced else "", m["name"]
        watch = _true(query.get("watch"))
        verb = {("GET", True): "get", ("GET", False): "list", ("POST", False): "create", ("PUT", True): "replace",
                ("DELETE", True): "delete", ("PATCH", True): "patch"}.get((method, name is not None))
        if verb is None or verb not in res.verbs or (verb == "create" and not ns and res.namespaced) \
                or (m["sub"] and verb != "get") or (watch and verb != "list"):
            raise ApiError(405, "MethodNotAllowed", f"fake_kube: {method} {path} is not emulated")
        dry = query.get("dryRun") == "All"  # the only value Kubernetes accepts
        with self._cond:
            if m["sub"] == "log":
                return 200, self._logs(ns, name, query), {}
            if watch:
                return 200, self._watch(res, m["ns"], query), {}
            if verb == "list":
                return 200, self._list(res, m["ns"], query), {}
            if verb == "create":
                return 201, self._create(res, ns, body, dry), {}
            current = self._objects.get((res.plural, ns, name))
            if current is None:
                raise ApiError(404, "NotFound", f'{self._qual(res)} "{name}" not found')
            if verb == "get":
                return 200, copy.deepcopy(current), {}
            if verb == "replace":
                return 200, self._replace(res, ns, name, current, body, dry), {}
            if verb == "patch":
                return 200, self._patch(res, ns, current, body, ctype, dry), {}
            return self._delete(res, ns, name, current, body or {}, query, dry)

    @staticmethod
    def _qual(res: _Resource) -> str:
        group = res.api_version.rpartition("/")[0]
        return f"{res.plural}.{group}" if group else res.plural

    def _store(self, plural: str, ns: str, obj: dict, new: bool = False) -> dict:
        self._rv += 1
        meta = obj["metadata"]
        if new:
            meta.setdefault("uid", str(uuid.uuid4()))  # a Job's uid is chosen earlier, for its pod labels
            meta["creationTimestamp"] = _now()
            if plural != "nodes":
                meta["namespace"] = ns
            if "spec" in obj:
                meta["generation"] = 1
        meta["resourceVersion"] = str(self._rv)
        self._objects[(plural, ns, meta["name"])] = obj
        self._event("ADDED" if new else "MODIFIED", plural, ns, obj)
        return copy.deepcopy(obj)

    def _event(self, kind: str, plural: str, ns: str, obj: dict) -> None:
        if kind == "DELETED":
            self._rv += 1
            obj["metadata"]["resourceVersion"] = str(self._rv)
        self._events.append((self._rv, kind, plural, ns, copy.deepcopy(obj)))
        self._cond.notify_all()

    def _admit(self, res: _Resource, ns: str, body: Any) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "fake_kube: the body must be a JSON object")
        obj = copy.deepcopy(body)
        for key, want in (("apiVersion", res.api_version), ("kind", res.kind)):
            if obj.setdefault(key, want) != want:
                raise ApiError(400, "BadRequest", f"{key} {obj[key]!r} does not match the URL's {want!r}")
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + _suffix()
        if not meta.get("name"):
            raise ApiError(422, "Invalid", f"{res.kind} is invalid: metadata.name: Required value")
        if meta.get("namespace", ns) != ns:
            raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                              "sent on the request")
        _validate(obj)
        return obj

    def _list(self, res: _Resource, ns: str | None, query: dict) -> dict:
        labels, fields = _selector(query.get("labelSelector")), _field_selector(query.get("fieldSelector"))
        items = []
        for (plural, ons, _), obj in sorted(self._objects.items()):
            if plural == res.plural and ns in (None, ons) and labels(obj["metadata"].get("labels", {})) \
                    and fields(obj):
                items.append({k: copy.deepcopy(v) for k, v in obj.items() if k not in ("apiVersion", "kind")})
        return {"apiVersion": res.api_version, "kind": f"{res.kind}List",
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _watch(self, res: _Resource, ns: str | None, query: dict) -> _Stream:
        """Watch events as JSON lines: ADDED for what exists (unless resourceVersion says where to resume), then every
        change, until timeoutSeconds or the fake stops."""
        labels, fields = _selector(query.get("labelSelector")), _field_selector(query.get("fieldSelector"))
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 3600)
        since = query.get("resourceVersion")
        if since in (None, "", "0"):
            backlog = [(0, "ADDED", p, o_ns, copy.deepcopy(o)) for (p, o_ns, _), o in sorted(self._objects.items())]
            pos = len(self._events)
        else:
            backlog, pos = [], next((i for i, e in enumerate(self._events) if e[0] > int(since)), len(self._events))

        def chunks() -> Iterator[bytes]:
            nonlocal pos
            pending = backlog
            while True:
                for _, kind, plural, o_ns, obj in pending:
                    if plural == res.plural and ns in (None, o_ns) and labels(obj["metadata"].get("labels", {})) \
                            and fields(obj):
                        yield json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                with self._cond:
                    self._cond.wait_for(lambda seen=pos: len(self._events) > seen or self._stopping,
                                        timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                    if self._stopping or time.monotonic() >= deadline:
                        return
                    pending, pos = self._events[pos:], len(self._events)
        return _Stream(chunks(), "application/json")

    def _create(self, res: _Resource, ns: str, body: Any, dry: bool) -> dict:
        obj = self._admit(res, ns, body)
        name = obj["metadata"]["name"]
        if (res.plural, ns, name) in self._objects:
            raise ApiError(409, "AlreadyExists", f'{self._qual(res)} "{name}" already exists')
        if obj["metadata"].get("resourceVersion"):
            raise ApiError(400, "BadRequest", "resourceVersion should not be set on objects to be created")
        obj.pop("status", None)
        obj["metadata"].pop("uid", None)
        if res.kind == "Job":
            self._default_job(obj)
        if dry:
            return obj
        if res.kind == "Service" and obj.setdefault("spec", {}).get("clusterIP") != "None":
            self._ips += 1
            obj["spec"].setdefault("type", "ClusterIP")
            obj["spec"]["clusterIP"] = f"10.96.{self._ips // 250}.{self._ips % 250 + 1}"
            obj["spec"]["clusterIPs"] = [obj["spec"]["clusterIP"]]
        stored = self._store(res.plural, ns, obj, new=True)
        if res.kind == "Deployment":
            self._deployment_status(obj)
            stored = self._store(res.plural, ns, obj)
        if res.kind == "Job":
            self._spawn(self._run_job, ns, name, obj["metadata"]["uid"])
        return stored

    def _replace(self, res: _Resource, ns: str, name: str, current: dict, body: Any, dry: bool) -> dict:
        obj = self._admit(res, ns, body)
        meta, old = obj["metadata"], current["metadata"]
        if meta["name"] != name:
            raise ApiError(400, "BadRequest", f"the name of the object ({meta['name']}) does not match the name on "
                                              f"the URL ({name})")
        if meta.get("resourceVersion") not in (None, old["resourceVersion"]):
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {self._qual(res)} "{name}": the object '
                                            "has been modified; please apply your changes to the latest version and "
                                            "try again")
        if res.kind == "Job":
            self._default_job(obj, uid=old["uid"])
            if obj["spec"]["template"] != current["spec"]["template"]:
                raise ApiError(422, "Invalid", f'Job.batch "{name}" is invalid: spec.template: Invalid value: '
                                               "field is immutable")
        if res.kind == "Service":  # an allocated cluster IP survives a replace that does not name it
            for key in ("clusterIP", "clusterIPs", "type"):
                if key in current["spec"]:
                    obj.setdefault("spec", {}).setdefault(key, current["spec"][key])
        return self._update(res, ns, current, obj, dry)

    def _update(self, res: _Resource, ns: str, current: dict, obj: dict, dry: bool) -> dict:
        meta, old = obj["metadata"], current["metadata"]
        meta.update(uid=old["uid"], creationTimestamp=old["creationTimestamp"])
        if "namespace" in old:
            meta["namespace"] = old["namespace"]
        if "generation" in old:
            meta["generation"] = old["generation"] + (obj.get("spec") != current.get("spec"))
        if "status" in current:  # the main resource does not write status
            obj["status"] = copy.deepcopy(current["status"])
        if res.kind == "Deployment":
            self._deployment_status(obj)
        return obj if dry else self._store(res.plural, ns, obj)

    def _patch(self, res: _Resource, ns: str, current: dict, body: Any, ctype: str, dry: bool) -> dict:
        kind = ctype.split(";")[0].strip()
        if kind == "application/json-patch+json" and isinstance(body, list):
            patched = json_patch(current, body)
        elif kind == "application/merge-patch+json" or (kind == "application/strategic-merge-patch+json"
                                                         and res.kind in ("Node", "ConfigMap")):
            if _directives(body):  # strategic directives ($patch, $retainKeys, ...) would change the meaning
                raise ApiError(415, "UnsupportedMediaType", "fake_kube: strategic-merge directives are not emulated")
            patched = merge_patch(current, body)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"fake_kube: PATCH {kind} on {res.plural} is not emulated")
        for key in ("name", "uid", "namespace"):
            if patched.get("metadata", {}).get(key) != current["metadata"].get(key):
                raise ApiError(422, "Invalid", f"metadata.{key}: field is immutable")
        _validate(patched)
        return self._update(res, ns, current, patched, dry)

    def _delete(self, res: _Resource, ns: str, name: str, current: dict, body: dict, query: dict,
                dry: bool) -> tuple:
        unknown = set(body) - {"apiVersion", "kind", "propagationPolicy", "gracePeriodSeconds", "preconditions",
                               "orphanDependents", "dryRun"}
        policy = body.get("propagationPolicy") or query.get("propagationPolicy")
        if unknown or policy not in (None, "Orphan", "Background", "Foreground"):
            raise ApiError(400, "BadRequest", f"fake_kube: bad DeleteOptions {body}")
        uid = current["metadata"]["uid"]
        if (body.get("preconditions") or {}).get("uid") not in (None, uid):
            raise ApiError(409, "Conflict", f'{self._qual(res)} "{name}": precondition failed: UID mismatch')
        headers = {"Warning": _ORPHAN_WARNING} if res.kind == "Job" and policy is None else {}
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                  "details": {"name": name, "group": res.api_version.rpartition("/")[0], "kind": res.plural,
                              "uid": uid}}
        if dry:
            return 200, status, headers
        del self._objects[(res.plural, ns, name)]
        self._event("DELETED", res.plural, ns, current)
        grace = float(body.get("gracePeriodSeconds", 30))
        if res.kind == "Pod":
            self._kill_later(ns, name, grace)
        if res.kind == "Job":
            for key, pod in list(self._objects.items()):
                refs = pod["metadata"].get("ownerReferences", [])
                if key[0] == "pods" and any(r["uid"] == uid for r in refs):
                    if policy in ("Background", "Foreground"):
                        del self._objects[key]
                        self._event("DELETED", "pods", ns, pod)
                        self._kill_later(ns, key[2], grace)
                    else:  # orphaned: the garbage collector drops the owner reference and leaves the pod running
                        pod["metadata"]["ownerReferences"] = [r for r in refs if r["uid"] != uid]
                        self._store("pods", ns, pod)
        return 200, status, headers

    # -- Deployments and Jobs ----------------------------------------------------------------------------------------

    def _deployment_status(self, obj: dict) -> None:
        meta, replicas = obj["metadata"], obj["spec"].get("replicas", 1)
        ready, now = self._ready.get((meta["namespace"], meta["name"]), True), _now()

        def cond(kind: str, ok: bool, reason: str) -> dict:
            return {"type": kind, "status": str(ok), "reason": reason, "lastUpdateTime": now,
                    "lastTransitionTime": now}
        status = {"observedGeneration": meta.get("generation", 1), "replicas": replicas, "updatedReplicas": replicas}
        if ready:
            status.update(readyReplicas=replicas, availableReplicas=replicas, conditions=[
                cond("Available", True, "MinimumReplicasAvailable"),
                cond("Progressing", True, "NewReplicaSetAvailable")])
        else:
            status.update(unavailableReplicas=replicas, conditions=[
                cond("Available", False, "MinimumReplicasUnavailable"), cond("Progressing", True, "ReplicaSetUpdated")])
        obj["status"] = status

    def _default_job(self, obj: dict, uid: str | None = None) -> None:
        spec, name = obj["spec"], obj["metadata"]["name"]
        pod = spec["template"].setdefault("spec", {})
        if pod.get("restartPolicy") not in ("Never", "OnFailure"):
            raise ApiError(422, "Invalid", f'Job.batch "{name}" is invalid: spec.template.spec.restartPolicy: '
                                           'Required value: valid values: "OnFailure", "Never"')
        if spec.get("completionMode") == "Indexed" and spec.get("completions") is None:
            raise ApiError(422, "Invalid", f'Job.batch "{name}" is invalid: spec.completions: Required value: when '
                                           "completion mode is Indexed")
        for unsupported in ("podFailurePolicy", "backoffLimitPerIndex", "successPolicy", "suspend", "manualSelector"):
            if spec.get(unsupported):
                raise ApiError(422, "Invalid", f"fake_kube: Job spec.{unsupported} is not emulated")
        for key, default in (("completions", 1), ("parallelism", 1), ("backoffLimit", 6),
                             ("completionMode", "NonIndexed")):
            spec.setdefault(key, default)
        uid = uid or obj["metadata"].get("uid") or str(uuid.uuid4())
        obj["metadata"]["uid"] = uid  # the controller-uid labels need it before _store would set it
        owned = {"batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
                 "batch.kubernetes.io/job-name": name, "job-name": name}
        spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
        spec["template"].setdefault("metadata", {}).setdefault("labels", {}).update(owned)

    def _job_alive(self, ns: str, name: str, uid: str) -> dict | None:
        job = self._objects.get(("jobs", ns, name))
        return job if job and job["metadata"]["uid"] == uid else None

    def _run_job(self, ns: str, name: str, uid: str) -> None:
        with self._cond:
            job = self._job_alive(ns, name, uid)
            if job is None:
                return
            spec = job["spec"]
            indexed = spec["completionMode"] == "Indexed"
            pending, running, succeeded, failed = list(range(spec["completions"])), {}, set(), 0
            started = time.monotonic()
            job["status"] = {"startTime": _now(), "active": 0, "ready": 0}
        outcome = None
        while outcome is None:
            with self._cond:
                if self._stopping or self._job_alive(ns, name, uid) is None:
                    return  # deleted: no new pods; orphaned ones run on
            while pending and len(running) < spec["parallelism"]:
                index = pending.pop(0)
                running[index] = self._start_pod(ns, job, index if indexed else None)
            with self._cond:
                for index, run in list(running.items()):
                    if run.returncode is not None:
                        del running[index]
                        if run.returncode == 0:
                            succeeded.add(index)
                        else:
                            failed += 1
                            pending.append(index)
                deadline = spec.get("activeDeadlineSeconds")
                if len(succeeded) == spec["completions"]:
                    outcome = ("Complete", "SuccessCriteriaMet", "CompletionsReached",
                               "Reached expected number of succeeded pods")
                elif failed > spec["backoffLimit"]:
                    outcome = ("Failed", "FailureTarget", "BackoffLimitExceeded", "Job has reached the specified "
                                                                                 "backoff limit")
                elif deadline is not None and time.monotonic() - started > deadline:
                    outcome = ("Failed", "FailureTarget", "DeadlineExceeded", "Job was active longer than "
                                                                             "specified deadline")
                job = self._job_alive(ns, name, uid)
                if job is None:
                    return
                status = job["status"]
                status.update(active=len(running), ready=sum(r.started and r.returncode is None
                                                             for r in running.values()),
                              succeeded=len(succeeded), failed=failed)
                if indexed and succeeded:
                    status["completedIndexes"] = _ranges(succeeded)
                if outcome is not None:
                    now = _now()
                    status["conditions"] = [{"type": t, "status": "True", "reason": outcome[2], "message": outcome[3],
                                             "lastProbeTime": now, "lastTransitionTime": now} for t in outcome[1::-1]]
                    if outcome[0] == "Complete":
                        status["completionTime"] = now
                    status.update(active=0, ready=0)
                self._store("jobs", ns, job)
                if outcome is None and not (pending and len(running) < spec["parallelism"]):
                    left = None if deadline is None else max(0.0, deadline - (time.monotonic() - started)) + 0.01
                    self._cond.wait_for(lambda: self._stopping or self._job_alive(ns, name, uid) is None
                                        or any(r.returncode is not None for r in running.values()),
                                        timeout=min(left or 1.0, 1.0))
        for run in running.values():  # a failed Job stops its remaining pods
            fake_kubelet.kill(run, grace=1.0)

    def _schedule(self, pod_spec: dict) -> str | None:
        nodes = [o for (p, _, _), o in sorted(self._objects.items()) if p == "nodes"]
        if not nodes:
            return "fake-node"
        selector, tolerations = pod_spec.get("nodeSelector", {}), pod_spec.get("tolerations", [])
        fits = [n["metadata"]["name"] for n in nodes
                if selector.items() <= n["metadata"].get("labels", {}).items()
                and all(_tolerated(t, tolerations) for t in n.get("spec", {}).get("taints", [])
                        if t.get("effect") in ("NoSchedule", "NoExecute"))]
        self._rr += 1
        return fits[self._rr % len(fits)] if fits else None

    def _start_pod(self, ns: str, job: dict, index: int | None) -> PodRun:
        jname, template = job["metadata"]["name"], job["spec"]["template"]
        name = f"{jname}-{index}-{_suffix()}" if index is not None else f"{jname}-{_suffix()}"
        meta = copy.deepcopy(template.get("metadata", {}))
        meta.update(name=name, ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job", "name": jname,
                                                 "uid": job["metadata"]["uid"], "controller": True,
                                                 "blockOwnerDeletion": True}])
        spec = copy.deepcopy(template["spec"])
        if index is not None:
            meta.setdefault("labels", {})[_INDEX] = str(index)
            meta.setdefault("annotations", {})[_INDEX] = str(index)
            spec["hostname"] = f"{jname}-{index}"
            for c in spec["containers"]:  # as the Job controller adds it: last, from the annotation, unless set
                if not any(v["name"] == "JOB_COMPLETION_INDEX" for v in c.get("env", [])):
                    c.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {
                        "fieldRef": {"fieldPath": f"metadata.annotations['{_INDEX}']"}}})
        run = PodRun(ns, name)
        with self._cond:
            node = self._schedule(spec)
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": "Pending"}}
            if node is None:
                pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                "message": "fake_kube: no node matches nodeSelector and taints"}]
            else:
                spec["nodeName"] = node
                pod["status"].update(conditions=[{"type": "PodScheduled", "status": "True"}],
                                     containerStatuses=[self._cstatus(c, {"waiting": {"reason": "ContainerCreating"}})
                                                        for c in spec["containers"]])
            _validate(pod)
            self.runs.append(run)
            self._store("pods", ns, pod, new=True)
        if node is not None:
            self._spawn(self._run_pod, run, pod)
        return run

    @staticmethod
    def _cstatus(container: dict, state: dict, ready: bool = False) -> dict:
        return {"name": container["name"], "image": container.get("image", ""), "imageID": "", "ready": ready,
                "restartCount": 0, "started": "running" in state, "state": state}

    def _configmap(self, ns: str, ref: dict) -> dict[str, str]:
        with self._cond:
            cm = self._objects.get(("configmaps", ns, ref["name"]))
        if cm is None and not ref.get("optional"):
            raise StartError(f'configmap "{ref["name"]}" not found')
        return dict((cm or {}).get("data", {}))

    def _run_pod(self, run: PodRun, pod: dict) -> None:
        try:
            argv, env, cwd = fake_kubelet.launch(pod, self.machine, self._configmap)
            with self._cond:  # under the lock: stop() sets _stopping, then kills every process it can see
                if self._stopping:
                    raise StartError("fake_kube: stopping")
                fake_kubelet.start(run, argv, env, cwd)
        except (StartError, OSError) as e:
            run.start_error, run.eof, run.returncode = str(e), True, 128
            self._set_pod(run, "Failed", {"terminated": {"exitCode": 128, "reason": "StartError", "message": str(e),
                                                         "startedAt": _now(), "finishedAt": _now()}})
            return
        started_at = _now()
        self._set_pod(run, "Running", {"running": {"startedAt": started_at}}, ready=True)
        code = fake_kubelet.pump(run, self._cond, self.process_timeout)
        with self._cond:
            run.returncode, run.eof = code, True
        self._set_pod(run, "Succeeded" if code == 0 else "Failed", {"terminated": {
            "exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": started_at,
            "finishedAt": _now(), "containerID": f"fake://{run.proc.pid}"}})  # type: ignore[union-attr]


    def _set_pod(self, run: PodRun, phase: str, state: dict, ready: bool = False) -> None:
        with self._cond:
            pod = self._objects.get(("pods", run.namespace, run.pod))
            if pod is None:
                self._cond.notify_all()
                return  # deleted while running: nothing to write back
            now, status = _now(), pod["status"]
            status["phase"] = phase
            status.setdefault("startTime", now)
            status.update(podIP="127.0.0.1", hostIP="127.0.0.1", containerStatuses=[
                self._cstatus(c, state if i == 0 else {"waiting": {"reason": "fake_kube: only the first container "
                                                                              "runs"}}, ready and i == 0)
                for i, c in enumerate(pod["spec"]["containers"])])
            status["conditions"] = [{"type": t, "status": str(ready or t in ("PodScheduled", "Initialized")),
                                     "lastTransitionTime": now}
                                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
            self._store("pods", run.namespace, pod)

    def _kill_later(self, ns: str, pod: str, grace: float) -> None:
        for run in self.runs:
            if (run.namespace, run.pod) == (ns, pod):
                self._spawn(fake_kubelet.kill, run, min(grace, 5.0))

    def _spawn(self, target: Callable, *args: Any, **kwargs: Any) -> None:
        t = threading.Thread(target=self._guard, args=(target, *args), kwargs=kwargs, daemon=True)
        self._threads.append(t)
        t.start()

    def _guard(self, target: Callable, *args: Any, **kwargs: Any) -> None:
        try:
            target(*args, **kwargs)
        except Exception:
            self.errors.append(traceback.format_exc())

    # -- pod logs ----------------------------------------------------------------------------------------------------

    def _logs(self, ns: str, name: str, query: dict) -> _Stream:
        pod = self._objects.get(("pods", ns, name))
        if pod is None:
            raise ApiError(404, "NotFound", f'pods "{name}" not found')
        names = [c["name"] for c in pod["spec"]["containers"]]
        container = query.get("container", names[0])
        if container not in names:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {name}")
        run = next((r for r in self.runs if (r.namespace, r.pod) == (ns, name)), None)
        if run is None or not (run.started or run.start_error):
            raise ApiError(400, "BadRequest", f'container "{container}" in pod "{name}" is waiting to start: '
                                              "ContainerCreating")
        if _true(query.get("previous")):
            raise ApiError(400, "BadRequest", f'previous terminated container "{container}" in pod "{name}" not found')
        follow, start = _true(query.get("follow")), 0
        if "sinceSeconds" in query:
            since = fake_kubelet.nano(time.time_ns() - int(query["sinceSeconds"]) * 10**9)
            start = next((i for i, (ts, _) in enumerate(run.lines) if ts >= since), len(run.lines))
        if "tailLines" in query:
            start = max(start, len(run.lines) - int(query["tailLines"]))
        if container != names[0]:
            follow, start = False, len(run.lines)  # only the first container runs; the others have no output
        return _Stream(fake_kubelet.log_chunks(run, self._cond, start, follow, _true(query.get("timestamps")),
                                               lambda: self._stopping), "text/plain")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fake: FakeKube) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fake = fake
        self.connections: set[socket.socket] = set()

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.connections.discard(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass  # the fake records requests itself; stderr noise would drown test output

    def _serve(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        code, body, headers = self.server.fake.dispatch(  # type: ignore[attr-defined]
            self.command, self.path, raw, self.headers.get("Content-Type"))
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        if isinstance(body, _Stream):
            self.send_header("Content-Type", body.content_type)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for chunk in body.chunks:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            return
        data = json.dumps(body).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve
