"""Preflight on Kubernetes (factory/deploy/preflight.py, factory/ops/preflight/mark.py): the RBAC and per-node Jobs
strictly valid against the Kubernetes 1.37 schemas and snapshotted; each Job pinned to its node with the profile's
tolerations, a training pod's GPUs and volumes; the merge patch that marks a node (taint added or removed, other
taints kept, labels, annotation) and the Node it produces valid; training pods not tolerating the taint; and
`factory preflight --mark-node` marking a node over HTTP, then clearing it.

No API server here: the calls go to the fake API server (tests/deploy/fake_kube.py), which schedules the rendered Job
by its tolerations and runs its pod as a local process, and, for a conflicting writer, to a small server in this file.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

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
from tests.deploy.fake_kube import FakeKube, merge_patch
from tests.ports import refusing_port

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = Path(__file__).parent / "snapshots"
K8S_VERSION = "1.37.0"
PROFILE = ROOT / "deploy" / "profile.example.yaml"
SPEC = ROOT / "examples" / "k8s.yaml"
GPU = "nvidia.com/gpu"
NS = "factory"
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
    for bad in (-1, 3):
        with pytest.raises(RenderError, match=f"--gpus-per-node: a preflight pod holds 0, 1, 2, 4 or 8 .*got {bad}"):
            render_preflight(["a"], DeployProfile(), gpus=bad)
    with pytest.raises(RenderError, match="^gpus_per_train_pod: .* got 6"):
        render_preflight(["a"], DeployProfile(gpus_per_train_pod=6))
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
    after = merge_patch(node, patch)
    validate(after, "the failed Node")
    assert after["spec"]["taints"] == [GPU_TAINT, CORDON, {"key": TAINT_KEY, "value": "0123456789ab",
                                                           "effect": "NoSchedule"}]
    assert after["metadata"]["labels"] == {"kubernetes.io/hostname": "gpu-node-1", LABEL: "failed"}
    again = merge_patch(after, node_patch(after, a_report(("accelerators", False), pid="bbbbbbbbbbbb")))
    assert [t["key"] for t in again["spec"]["taints"]] == [GPU, CORDON_TAINT, TAINT_KEY]  # one taint, not two
    assert again["spec"]["taints"][-1]["value"] == "bbbbbbbbbbbb"


def test_passing_patch_removes_only_the_preflight_taint() -> None:
    failed = merge_patch(a_node(), node_patch(a_node(), a_report(("accelerators", False))))
    passed = merge_patch(failed, node_patch(failed, a_report(("accelerators", True), ("matmul", True))))
    validate(passed, "the passed Node")
    assert passed["spec"]["taints"] == [GPU_TAINT, CORDON]
    assert passed["metadata"]["labels"][LABEL] == "passed"
    assert json.loads(passed["metadata"]["annotations"][ANNOTATION])["failed"] == []
    bare = merge_patch(a_node(taints=[]), node_patch(a_node(taints=[]), a_report(("python", True))))
    validate(bare, "a Node without taints")
    assert bare["spec"]["taints"] == []


def test_a_partial_run_keeps_failures_it_did_not_recheck() -> None:
    failed = merge_patch(a_node(), node_patch(a_node(), a_report(("accelerators", False), ("matmul", False))))
    # `factory preflight --check matmul` after a fix: accelerators was not re-run, so the node stays failed
    still = merge_patch(failed, node_patch(failed, a_report(("matmul", True)), partial=True))
    assert still["metadata"]["labels"][LABEL] == "failed" and still["spec"]["taints"][-1]["key"] == TAINT_KEY
    assert json.loads(still["metadata"]["annotations"][ANNOTATION])["failed"] == ["accelerators"]
    cleared = merge_patch(still, node_patch(still, a_report(("accelerators", True)), partial=True))
    assert cleared["metadata"]["labels"][LABEL] == "passed" and cleared["spec"]["taints"] == [GPU_TAINT, CORDON]
    # a full run judges the node afresh; an annotation that is not ours is ignored
    odd = a_node(**{ANNOTATION: "not json"})
    assert node_patch(odd, a_report(("python", True)), partial=True)["metadata"]["labels"][LABEL] == "passed"


# -- over HTTP: a cluster made of the fake API server (tests/deploy/fake_kube.py) -----------------------------------


def no_op_like_training(train_job: dict, name: str) -> dict:
    """A Job whose pod is placed as the training pods are (their node selector and tolerations) and runs nothing."""
    placement = {k: v for k, v in pod(train_job).items() if k in ("nodeSelector", "tolerations")}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": {"test": name}},
            "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": {"test": name}}, "spec": {
                "restartPolicy": "Never", "containers": [{"name": "c", "image": "factory:test",
                                                          "command": [sys.executable, "-c", "pass"]}],
                **placement}}}}


@pytest.mark.slow
def test_preflight_job_on_a_fake_cluster_taints_a_failing_node_keeps_training_off_and_a_rerun_clears_it(
        fake_kube: FakeKube, tmp_path: Path) -> None:
    """The rendered Job, created in the fake cluster, runs `factory preflight --mark-node` as a local process on the
    node the fake scheduled it to; NODE_NAME comes from spec.nodeName. Two changes for this machine: the command is
    the Job's args (the image's entrypoint, tini, is not here) narrowed to one check, `accelerators`, so the run takes
    well under a second instead of the ~15 s quick preflight; and FACTORY_NODE_KIND picks the verdict: a kind
    expecting 8 GPUs fails on a PATH without nvidia-smi, `cpu` passes."""
    fake_kube.add_node("gpu-node-1", {"cloud.example.com/pool": "gpu-h100"}, taints=[GPU_TAINT])
    profile = load_profile(PROFILE).model_copy(update={"env_secret": None})  # the fake has no Secrets
    fake_kube.path_map["/data"] = str(tmp_path / "data")
    fake_kube.extra_env.update(KUBECONFIG=str(fake_kube.write_kubeconfig(tmp_path / "kubeconfig")),
                               PATH=str(Path(sys.executable).parent), FACTORY_NODE_KIND="gpu-h100x8")
    job = jobs(render_preflight(["gpu-node-1"], profile))["gpu-node-1"]
    container = pod(job)["containers"][0]
    container["command"] = [*container.pop("args"), "--check", "accelerators", "--no-record"]
    name = job["metadata"]["name"]
    train_job = render(load_spec(SPEC), profile)["train-job.yaml"]
    with fake_kube.api_client() as api:
        batch = client.BatchV1Api(api)
        batch.create_namespaced_job(NS, job)
        failed = fake_kube.wait_job(name, NS)
        run = fake_kube.runs[-1]
        assert failed["status"]["failed"] == 1, run.output()
        assert run.env["NODE_NAME"] == run.env["FACTORY_NODE"] == "gpu-node-1"
        assert "node gpu-node-1 marked factory.dev/preflight=failed" in run.output()
        node = fake_kube.node("gpu-node-1")
        assert node["metadata"]["labels"][LABEL] == "failed"
        assert node["spec"]["taints"] == [GPU_TAINT, {"key": TAINT_KEY, "value": node["spec"]["taints"][1]["value"],
                                                      "effect": "NoSchedule"}]
        assert json.loads(node["metadata"]["annotations"][ANNOTATION])["failed"] == ["accelerators"]

        batch.create_namespaced_job(NS, no_op_like_training(train_job, "train-a"))  # the scheduler keeps it off
        fake_kube.wait(lambda: fake_kube.list("Pod", NS, {"test": "train-a"}), what="train-a's pod")
        (shunned,) = fake_kube.list("Pod", NS, {"test": "train-a"})
        assert shunned["status"]["phase"] == "Pending" and "nodeName" not in shunned["spec"]
        assert shunned["status"]["conditions"][0]["reason"] == "Unschedulable"

        batch.delete_namespaced_job(name, NS, propagation_policy="Background")
        fake_kube.extra_env["FACTORY_NODE_KIND"] = "cpu"  # the node fixed: its re-test passes
        batch.create_namespaced_job(NS, job)  # it tolerates the failed taint, so it lands on the failed node
        done = fake_kube.wait_job(name, NS)
        assert done["status"].get("succeeded") == 1, fake_kube.runs[-1].output()
        node = fake_kube.node("gpu-node-1")
        assert node["metadata"]["labels"][LABEL] == "passed" and node["spec"]["taints"] == [GPU_TAINT]

        batch.create_namespaced_job(NS, no_op_like_training(train_job, "train-b"))  # and training is back on it
        assert fake_kube.wait_job("train-b", NS)["status"].get("succeeded") == 1
        (placed,) = fake_kube.list("Pod", NS, {"test": "train-b"})
        assert placed["spec"]["nodeName"] == "gpu-node-1"
    assert {r.content_type for r in fake_kube.requests if r.method == "PATCH"} == {MERGE_PATCH}


def test_cli_mark_node_errors_name_the_node_and_the_answer(fake_kube: FakeKube, tmp_path: Path, monkeypatch,
                                                           capsys) -> None:
    kubeconfig = str(fake_kube.write_kubeconfig(tmp_path / "kubeconfig"))
    monkeypatch.setenv("NODE_NAME", "nope")
    assert main(["preflight", "--check", "python", "--no-record", "--mark-node", "--kubeconfig", kubeconfig]) == 1
    assert 'cannot mark node nope: API server answered 404 Not Found: nodes "nope" not found' in \
        capsys.readouterr().err
    monkeypatch.delenv("NODE_NAME")
    sent = len(fake_kube.requests)
    assert main(["preflight", "--check", "python", "--mark-node", "--kubeconfig", kubeconfig]) == 2
    assert "--mark-node: $NODE_NAME is not set" in capsys.readouterr().err
    assert len(fake_kube.requests) == sent  # refused up front: nothing measured, nothing sent
    port = refusing_port()  # nothing listens there
    dead = tmp_path / "dead-kubeconfig"
    dead.write_text(Path(kubeconfig).read_text().replace(fake_kube.host, f"http://127.0.0.1:{port}"))
    with pytest.raises(MarkError, match="cannot mark node gpu-node-1: .*(Connection refused|Max retries)"):
        mark_node("gpu-node-1", a_report(("python", True)), kubeconfig=str(dead))
    with pytest.raises(MarkError, match=f"--kubeconfig: no such file: {tmp_path}/none"):
        mark_node("gpu-node-1", a_report(("python", True)), kubeconfig=str(tmp_path / "none"))
    (tmp_path / "garbage").write_text("just text\n")
    with pytest.raises(MarkError, match=f"--kubeconfig: {tmp_path}/garbage is not a usable kubeconfig"):
        mark_node("gpu-node-1", a_report(("python", True)), kubeconfig=str(tmp_path / "garbage"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(MarkError, match="no Kubernetes credentials: give --kubeconfig"):
        mark_node("gpu-node-1", a_report(("python", True)))


# -- a conflicting writer: fake_kube applies a PATCH whatever its resourceVersion, so this server answers 409 ------


class FakeNodes(ThreadingHTTPServer):
    """GET and merge-PATCH of /api/v1/nodes/{name}, answering 409 Conflict to a PATCH whose metadata.resourceVersion
    is stale, as the API server does; `race` is a taint another writer adds just before the next PATCH lands."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.nodes: dict[str, dict] = {}
        self.requests: list[str] = []
        self.race: dict | None = None


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

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.requests.append("GET")
        self._send(200, self.server.nodes[self.path.rsplit("/", 1)[-1]])

    def do_PATCH(self) -> None:  # noqa: N802
        self.server.requests.append("PATCH")
        name = self.path.rsplit("/", 1)[-1]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        node = self.server.nodes[name]
        if self.server.race is not None:  # another writer got there first
            node["spec"]["taints"].append(self.server.race)
            node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
            self.server.race = None
        if body["metadata"].get("resourceVersion") not in (None, node["metadata"]["resourceVersion"]):
            return self._send(409, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict",
                                    "code": 409, "message": "the object has been modified"})
        new = merge_patch(node, body)
        new["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        self.server.nodes[name] = new
        self._send(200, new)


def test_mark_node_retries_a_conflict_and_keeps_the_other_writers_taint(tmp_path: Path) -> None:
    server = FakeNodes()
    server.nodes["gpu-node-1"] = a_node()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
            "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        other = {"key": "example.com/maintenance", "effect": "NoSchedule"}
        server.race = other
        marked = mark_node("gpu-node-1", a_report(("matmul", False)), kubeconfig=str(kubeconfig))
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert [t["key"] for t in marked["spec"]["taints"]] == [GPU, CORDON_TAINT, other["key"], TAINT_KEY]
    assert server.requests == ["GET", "PATCH", "GET", "PATCH"]  # 409, read again, patch again
