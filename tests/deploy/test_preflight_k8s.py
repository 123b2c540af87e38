"""Preflight on Kubernetes (factory/deploy/preflight.py, factory/ops/preflight/mark.py): the RBAC and per-node Jobs
strictly valid against the Kubernetes 1.37 schemas and snapshotted; each Job pinned to its node with the profile's
tolerations, a training pod's GPUs and volumes; the merge patch that marks a node (taint added or removed, other
taints kept, labels, annotation) and the Node it produces valid; training pods not tolerating the taint; and
`factory preflight --mark-node` marking a node over HTTP, then clearing it.

No API server here: the HTTP calls go to a local server speaking the few Kubernetes API paths they use.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from factory.cli import main
from factory.config import load_spec
from factory.deploy.preflight import CORDON_TAINT, job_name, parse_nodes, render_preflight
from factory.deploy.profile import DeployProfile, load_profile
from factory.deploy.render import RenderError, render, to_text
from factory.ops.preflight.mark import (
    ANNOTATION,
    LABEL,
    MERGE_PATCH,
    TAINT_KEY,
    MarkError,
    mark_node,
    node_patch,
    tolerates,
)
from factory.ops.preflight.result import CheckResult, PreflightReport

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = Path(__file__).parent / "snapshots"
K8S_VERSION = "1.37.0"
PROFILE = ROOT / "deploy" / "profile.example.yaml"
SPEC = ROOT / "examples" / "k8s.yaml"
GPU = "nvidia.com/gpu"
NODES = ["gpu-node-1", "ip-10-0-1-2.ec2.internal"]
GPU_TAINT = {"key": GPU, "value": "present", "effect": "NoSchedule"}
CORDON = {"key": CORDON_TAINT, "effect": "NoSchedule", "timeAdded": "2026-11-24T07:00:00Z"}


def validate(obj: dict, where: str) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{where}: {e.message} at {'.'.join(map(str, e.path))}")


def jobs(manifests: dict[str, dict]) -> dict[str, dict]:
    """{node: its Job}."""
    return {o["metadata"]["annotations"]["factory.dev/node"]: o for o in manifests.values() if o["kind"] == "Job"}


def pod(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def gpus(p: dict) -> int:
    res = p["containers"][0]["resources"]
    assert res["requests"].get(GPU) == res["limits"].get(GPU)
    return int(res["limits"].get(GPU, 0))


# -- the manifests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_spec", [False, True])
@pytest.mark.parametrize("profile_path", [PROFILE, None])
def test_every_preflight_manifest_is_strictly_valid_kubernetes(profile_path: Path | None, with_spec: bool) -> None:
    spec = load_spec(SPEC) if with_spec else None
    manifests = render_preflight(NODES, load_profile(profile_path), spec)
    assert [o["kind"] for o in manifests.values()] == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                                       "Job", "Job"]
    for name, obj in manifests.items():
        validate(obj, name)
        assert len(obj["metadata"]["name"]) <= 63, name
    assert len({(o["kind"], o["metadata"]["name"]) for o in manifests.values()}) == len(manifests)


def test_preflight_manifests_match_snapshot() -> None:
    text = to_text(render_preflight(NODES, load_profile(PROFILE)))
    snapshot = SNAPSHOTS / "preflight.yaml"
    if os.environ.get("FACTORY_UPDATE_SNAPSHOTS") == "1":
        snapshot.write_text(text)
    assert snapshot.is_file(), f"no snapshot {snapshot}: run with FACTORY_UPDATE_SNAPSHOTS=1"
    assert text == snapshot.read_text(), f"preflight manifests differ from {snapshot} (review, then " \
        "FACTORY_UPDATE_SNAPSHOTS=1 to accept)"


def test_each_job_is_pinned_to_its_node_with_the_train_roles_gpus_tolerations_and_volumes() -> None:
    profile, spec = load_profile(PROFILE), load_spec(SPEC)
    train_pod = pod(render(spec, profile)["train-job.yaml"])
    for with_spec in (False, True):
        by_node = jobs(render_preflight(NODES, profile, spec if with_spec else None))
        assert set(by_node) == set(NODES)
        for node, job in by_node.items():
            p = pod(job)
            terms = p["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
            assert "nodeName" not in p and "nodeSelector" not in p  # through the scheduler; the node is named
            assert gpus(p) == gpus(train_pod) == 4  # a training pod's GPUs (the profile's 4)
            res = p["containers"][0]["resources"]["limits"]
            assert (res["cpu"], res["memory"]) == (profile.train.cpu, profile.train.memory)
            train_tolerations = [t.manifest() for t in profile.train.tolerations]
            assert p["tolerations"][:len(train_tolerations)] == train_tolerations == train_pod["tolerations"]
            assert tolerates(p["tolerations"]) and tolerates(p["tolerations"], key=CORDON_TAINT)
            want = {v["name"]: v for v in train_pod["volumes"]} if with_spec else \
                {v["name"]: v for v in train_pod["volumes"] if v["name"] != "spec"}
            assert {v["name"]: v for v in p["volumes"]} == want  # the training pods' volumes, as they have them
            c = p["containers"][0]
            assert {(m["name"], m["mountPath"]) for m in c["volumeMounts"]} == {
                (m["name"], m["mountPath"]) for m in train_pod["containers"][0]["volumeMounts"] if m["name"] in want}
            assert c["args"] == ["factory", "preflight", "--mark-node", "--verbose"]
            assert c["envFrom"] == train_pod["containers"][0]["envFrom"]  # the team's services, as training
            env = {e["name"]: e for e in c["env"]}
            assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
            assert env["FACTORY_NODE"]["value"] == "$(NODE_NAME)"  # node_health keyed by the node, not the pod
            assert job["spec"]["backoffLimit"] == 0 and p["restartPolicy"] == "Never"
    one = render_preflight(["n1"], DeployProfile(gpus_per_train_pod=8), None, deep=True, gpus=2)
    assert gpus(pod(jobs(one)["n1"])) == 2 and "--deep" in pod(jobs(one)["n1"])["containers"][0]["args"]
    cpu = pod(jobs(render_preflight(["n1"], DeployProfile(gpus_per_train_pod=0)))["n1"])
    assert GPU not in cpu["containers"][0]["resources"]["limits"]


def test_rbac_grants_get_and_patch_on_nodes_to_the_pods_account() -> None:
    manifests = render_preflight(NODES, load_profile(PROFILE))
    account, role, binding = (manifests[f"preflight-{k}.yaml"] for k in
                              ("serviceaccount", "clusterrole", "clusterrolebinding"))
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    for job in jobs(manifests).values():
        assert pod(job)["serviceAccountName"] == account["metadata"]["name"]
        assert job["metadata"]["namespace"] == account["metadata"]["namespace"] == "factory"


def test_training_pods_do_not_tolerate_the_preflight_taint() -> None:
    for spec_path, profile_path in ((SPEC, PROFILE), (ROOT / "examples" / "quickstart.yaml", None)):
        manifests = render(load_spec(spec_path), load_profile(profile_path))
        train = pod(manifests["train-job.yaml"])
        assert not tolerates(train.get("tolerations", [])), spec_path  # so the scheduler keeps them off
    # Kubernetes' matching rules: a key-less Exists tolerates every taint; effect and value must match when given.
    assert tolerates([{"operator": "Exists"}])
    assert not tolerates([{"key": TAINT_KEY, "operator": "Exists", "effect": "NoExecute"}])
    assert tolerates([{"key": TAINT_KEY, "operator": "Equal", "value": "abc"}], value="abc")
    assert not tolerates([{"key": TAINT_KEY, "value": "abc"}], value="def")


def test_bad_node_lists_are_named() -> None:
    assert parse_nodes(" a , b.example ,") == ["a", "b.example"]
    for text, match in (("", "no node names"), ("Node_1", "not a Kubernetes node name.*'Node_1'"),
                        ("a,b,a", "listed more than once: a")):
        with pytest.raises(RenderError, match=f"--nodes: {match}"):
            parse_nodes(text)
    with pytest.raises(RenderError, match="--gpus-per-node: expected 0 or more GPUs, got -1"):
        render_preflight(["a"], DeployProfile(), gpus=-1)
    tolerate_all = DeployProfile.model_validate({"train": {"tolerations": [{"key": GPU}, {"operator": "Exists"}]}})
    with pytest.raises(RenderError, match=f"train.tolerations.1: tolerates the taint {TAINT_KEY}"):
        render_preflight(["a"], tolerate_all)
    long = "n" * 100
    names = {job_name(n) for n in ("node-a", "node.a", long, long + "x")}
    assert len(names) == 4 and all(len(n) <= 63 for n in names)  # changed names get a hash: no two share a Job
    assert job_name("node-a") == "factory-preflight-node-a"


def test_cli_writes_the_manifests_and_names_bad_flags(tmp_path: Path, capsys) -> None:
    out = tmp_path / "preflight"
    argv = ["deploy", "preflight", "--nodes", ",".join(NODES), "--out", str(out), "--profile", str(PROFILE)]
    assert main(argv) == 0
    manifests = render_preflight(NODES, load_profile(PROFILE))
    assert sorted(p.name for p in out.iterdir()) == sorted(manifests)
    for name, obj in manifests.items():
        assert yaml.safe_load((out / name).read_text()) == obj
    assert main(argv) == 2 and "is not empty" in capsys.readouterr().err
    assert main([*argv, "--force", "--spec", str(SPEC), "--set", "trainer.world_size=2", "--gpus-per-node", "8"]) == 0
    job = yaml.safe_load((out / f"preflight-job-{job_name(NODES[0])}.yaml").read_text())
    assert gpus(pod(job)) == 8 and {"name": "spec", "configMap": {"name": "k8s-code-grpo-spec"}} in pod(job)["volumes"]
    assert main(["deploy", "preflight", "--nodes", "Bad_Node", "--out", str(tmp_path / "o2")]) == 2
    assert "--nodes: not a Kubernetes node name" in capsys.readouterr().err and not (tmp_path / "o2").exists()


# -- marking a node ---------------------------------------------------------------------------------------------


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge(out.get(k), v)
    return out


def a_node(name: str = "gpu-node-1", taints: list[dict] | None = None, **annotations: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "resourceVersion": "41", "labels": {"kubernetes.io/hostname": name},
                         **({"annotations": annotations} if annotations else {})},
            "spec": {"taints": [GPU_TAINT, CORDON] if taints is None else taints}}


def a_report(*results: tuple[str, bool], pid: str = "0123456789ab") -> PreflightReport:
    import datetime as dt

    return PreflightReport(pid, "gpu-node-1", "gpu-h100x8", "quick", dt.datetime(2026, 11, 24, 8, 0, tzinfo=dt.UTC),
                           [CheckResult(name, ok) for name, ok in results])


def test_failing_patch_taints_labels_and_annotates_keeping_other_taints() -> None:
    node = a_node()
    patch = node_patch(node, a_report(("accelerators", False), ("matmul", True), ("disk_free_lake", False)))
    assert patch["metadata"]["resourceVersion"] == "41"  # a node changed since the read is a 409, not a lost taint
    assert patch["metadata"]["labels"] == {LABEL: "failed"}
    assert json.loads(patch["metadata"]["annotations"][ANNOTATION]) == {
        "preflight_id": "0123456789ab", "failed": ["accelerators", "disk_free_lake"], "partial": False,
        "checked_at": "2026-11-24T08:00:00+00:00"}
    after = merge(node, patch)
    validate(after, "the failed Node")
    assert after["spec"]["taints"] == [GPU_TAINT, CORDON, {"key": TAINT_KEY, "value": "0123456789ab",
                                                           "effect": "NoSchedule"}]
    assert after["metadata"]["labels"] == {"kubernetes.io/hostname": "gpu-node-1", LABEL: "failed"}
    again = merge(after, node_patch(after, a_report(("accelerators", False), pid="bbbbbbbbbbbb")))
    assert [t["key"] for t in again["spec"]["taints"]] == [GPU, CORDON_TAINT, TAINT_KEY]  # one taint, not two
    assert again["spec"]["taints"][-1]["value"] == "bbbbbbbbbbbb"


def test_passing_patch_removes_only_the_preflight_taint() -> None:
    failed = merge(a_node(), node_patch(a_node(), a_report(("accelerators", False))))
    passed = merge(failed, node_patch(failed, a_report(("accelerators", True), ("matmul", True))))
    validate(passed, "the passed Node")
    assert passed["spec"]["taints"] == [GPU_TAINT, CORDON]
    assert passed["metadata"]["labels"][LABEL] == "passed"
    assert json.loads(passed["metadata"]["annotations"][ANNOTATION])["failed"] == []
    bare = merge(a_node(taints=[]), node_patch(a_node(taints=[]), a_report(("python", True))))
    validate(bare, "a Node without taints")
    assert bare["spec"]["taints"] == []


def test_a_partial_run_keeps_failures_it_did_not_recheck() -> None:
    failed = merge(a_node(), node_patch(a_node(), a_report(("accelerators", False), ("matmul", False))))
    # `factory preflight --check matmul` after a fix: accelerators was not re-run, so the node stays failed
    still = merge(failed, node_patch(failed, a_report(("matmul", True)), partial=True))
    assert still["metadata"]["labels"][LABEL] == "failed" and still["spec"]["taints"][-1]["key"] == TAINT_KEY
    assert json.loads(still["metadata"]["annotations"][ANNOTATION])["failed"] == ["accelerators"]
    cleared = merge(still, node_patch(still, a_report(("accelerators", True)), partial=True))
    assert cleared["metadata"]["labels"][LABEL] == "passed" and cleared["spec"]["taints"] == [GPU_TAINT, CORDON]
    # a full run judges the node afresh; an annotation that is not ours is ignored
    odd = a_node(**{ANNOTATION: "not json"})
    assert node_patch(odd, a_report(("python", True)), partial=True)["metadata"]["labels"][LABEL] == "passed"


# -- over HTTP --------------------------------------------------------------------------------------------------


class FakeNodes(ThreadingHTTPServer):
    """GET and PATCH (merge patch only) of /api/v1/nodes/{name}, with resourceVersion conflicts, as the API server
    answers them; `race` adds a taint of another writer before the next PATCH is applied (once)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.nodes: dict[str, dict] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.race: dict | None = None
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: FakeNodes

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                          "message": message, "code": code})

    def _node(self) -> str | None:
        prefix = "/api/v1/nodes/"
        return self.path.split("?")[0][len(prefix):] if self.path.startswith(prefix) else None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        name = self._node()
        self.server.requests.append(("GET", self.path, ""))
        with self.server.lock:
            node = self.server.nodes.get(name or "")
            if node is None:
                return self._status(404, "NotFound", f'nodes "{name}" not found')
            self._send(200, node)

    def do_PATCH(self) -> None:  # noqa: N802
        name = self._node()
        ctype = self.headers.get("Content-Type", "")
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.server.requests.append(("PATCH", self.path, ctype))
        with self.server.lock:
            node = self.server.nodes.get(name or "")
            if node is None:
                return self._status(404, "NotFound", f'nodes "{name}" not found')
            if ctype != MERGE_PATCH:
                return self._status(415, "UnsupportedMediaType", f"this server takes {MERGE_PATCH}, got {ctype}")
            if self.server.race is not None:  # another writer got there first
                node["spec"]["taints"].append(self.server.race)
                node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
                self.server.race = None
            want = body.get("metadata", {}).get("resourceVersion")
            if want is not None and want != node["metadata"]["resourceVersion"]:
                return self._status(409, "Conflict", "the object has been modified; please apply your changes to "
                                    "the latest version and try again")
            new = merge(node, body)
            new["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
            self.server.nodes[name] = new
            self._send(200, new)


@pytest.fixture
def fake_nodes(tmp_path: Path) -> Iterator[tuple[FakeNodes, str]]:
    """The server, seeded with gpu-node-1, and a kubeconfig file pointing at it."""
    server = FakeNodes()
    server.nodes["gpu-node-1"] = a_node()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "test", "user": {"token": "test-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "test"}}]}))
    try:
        yield server, str(kubeconfig)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_cli_mark_node_taints_a_failing_node_and_a_passing_run_clears_it(fake_nodes, factory_home, monkeypatch,
                                                                          tmp_path, capsys) -> None:
    server, kubeconfig = fake_nodes
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    monkeypatch.setenv("FACTORY_NODE", "gpu-node-1")
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no nvidia-smi: a node kind that expects 8 GPUs fails `accelerators`
    argv = ["preflight", "--check", "accelerators", "--no-record", "--mark-node", "--kubeconfig", kubeconfig]
    assert main([*argv, "--kind", "gpu-h100x8"]) == 1
    node = server.nodes["gpu-node-1"]
    validate(node, "the marked Node")
    assert node["metadata"]["labels"][LABEL] == "failed"
    assert node["spec"]["taints"][:2] == [GPU_TAINT, CORDON] and node["spec"]["taints"][2]["key"] == TAINT_KEY
    note = json.loads(node["metadata"]["annotations"][ANNOTATION])
    assert note["failed"] == ["accelerators"] and note["partial"] is True
    err = capsys.readouterr().err
    assert "expects 8 GPUs" in err and "node gpu-node-1 marked factory.dev/preflight=failed" in err
    assert {c for m, _, c in server.requests if m == "PATCH"} == {MERGE_PATCH}

    assert main([*argv, "--kind", "cpu"]) == 0  # the fix: the same check passes and clears the node
    node = server.nodes["gpu-node-1"]
    assert node["metadata"]["labels"][LABEL] == "passed" and node["spec"]["taints"] == [GPU_TAINT, CORDON]
    assert json.loads(node["metadata"]["annotations"][ANNOTATION])["failed"] == []


def test_mark_node_retries_a_conflict_and_keeps_the_other_writers_taint(fake_nodes) -> None:
    server, kubeconfig = fake_nodes
    other = {"key": "example.com/maintenance", "effect": "NoSchedule"}
    server.race = other
    marked = mark_node("gpu-node-1", a_report(("matmul", False)), kubeconfig=kubeconfig)
    assert [t["key"] for t in marked["spec"]["taints"]] == [GPU, CORDON_TAINT, other["key"], TAINT_KEY]
    assert [m for m, _, _ in server.requests] == ["GET", "PATCH", "GET", "PATCH"]  # 409, read again, patch


def test_mark_node_errors_name_the_node_and_the_answer(fake_nodes, tmp_path, monkeypatch, capsys) -> None:
    server, kubeconfig = fake_nodes
    with pytest.raises(MarkError, match='cannot mark node nope: API server answered 404 .*nodes \\\\"nope\\\\" not'):
        mark_node("nope", a_report(("python", True)), kubeconfig=kubeconfig)
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert main(["preflight", "--check", "python", "--mark-node", "--kubeconfig", kubeconfig]) == 2
    assert "--mark-node: $NODE_NAME is not set" in capsys.readouterr().err
    assert server.requests[-1][1] == "/api/v1/nodes/nope"  # nothing sent for the run refused up front
    closed = FakeNodes()  # a port nothing listens on once closed
    port = closed.server_address[1]
    closed.server_close()
    dead = tmp_path / "dead-kubeconfig"
    dead.write_text(Path(kubeconfig).read_text().replace(f":{server.server_address[1]}", f":{port}"))
    with pytest.raises(MarkError, match="cannot mark node gpu-node-1: .*(Connection refused|Max retries)"):
        mark_node("gpu-node-1", a_report(("python", True)), kubeconfig=str(dead))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(MarkError, match="no Kubernetes credentials: give --kubeconfig"):
        mark_node("gpu-node-1", a_report(("python", True)))
