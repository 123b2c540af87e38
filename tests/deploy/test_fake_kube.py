"""The fake Kubernetes API server (tests/deploy/fake_kube.py) through the official client: CRUD with real models, strict
validation, Deployment readiness, Jobs run as local processes (env, $(VAR) expansion, path_map, ConfigMap volumes,
status), deletion semantics, log streaming, node patches and taints, and dagster-k8s's Pipes log reader consuming it."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster_k8s.client import DagsterK8sError, DagsterKubernetesClient, WaitForPodState
from dagster_k8s.pipes import PipesK8sPodLogsMessageReader
from kubernetes import client, config, watch
from kubernetes.client import ApiException

from tests.deploy.fake_kube import FakeKube
from tests.deploy.fake_kubelet import Machine, expand, map_paths
from tests.polling import exits_within

NS = "default"
KILLED = (128 + 15, 128 + 9)  # SIGTERM, or SIGKILL after the grace period
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z"


@pytest.fixture
def apis(fake_kube: FakeKube):
    api = fake_kube.api_client()
    yield client.CoreV1Api(api), client.AppsV1Api(api), client.BatchV1Api(api)
    api.close()


def meta(name: str, **labels: str) -> client.V1ObjectMeta:
    return client.V1ObjectMeta(name=name, labels=labels or None)


def job(name: str, argv: list[str], *, completions: int | None = None, backoff: int = 0,
        env: list[client.V1EnvVar] | None = None, **pod: object) -> client.V1Job:
    """A Job whose first container runs argv; completions makes it Indexed with that many pods at once."""
    container = client.V1Container(name="main", image="factory:test", command=argv[:2], args=argv[2:], env=env,
                                   volume_mounts=pod.pop("mounts", None))
    spec = client.V1PodSpec(restart_policy="Never", containers=[container], **pod)
    return client.V1Job(metadata=meta(name), spec=client.V1JobSpec(
        backoff_limit=backoff, completions=completions, parallelism=completions,
        completion_mode="Indexed" if completions else None,
        template=client.V1PodTemplateSpec(metadata=meta("", app="factory"), spec=spec)))


def status_of(e: ApiException) -> dict:
    return json.loads(e.body)


@pytest.mark.slow
def test_crud_through_the_typed_clients_deserializes_into_models(fake_kube: FakeKube, apis) -> None:
    core, apps, _ = apis
    made = core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("spec", app="a"), data={"k": "1"}))
    core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("other", app="b"), data={"k": "2"}))
    assert (made.kind, made.api_version, made.data) == ("ConfigMap", "v1", {"k": "1"})
    assert made.metadata.uid and made.metadata.resource_version and made.metadata.creation_timestamp is not None
    assert core.read_namespaced_config_map("spec", NS).metadata.uid == made.metadata.uid

    assert [c.metadata.name for c in core.list_namespaced_config_map(NS, label_selector="app=a").items] == ["spec"]
    assert [c.metadata.name for c in core.list_namespaced_config_map(NS, label_selector="app!=a").items] == ["other"]
    assert len(core.list_namespaced_config_map(NS).items) == 2
    assert core.list_namespaced_config_map("elsewhere").items == []

    with pytest.raises(ApiException) as dup:
        core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("spec")))
    assert (dup.value.status, status_of(dup.value)["reason"]) == (409, "AlreadyExists")

    made.data = {"k": "3"}
    replaced = core.replace_namespaced_config_map("spec", NS, made)
    assert replaced.data == {"k": "3"} and replaced.metadata.resource_version != made.metadata.resource_version
    with pytest.raises(ApiException) as stale:  # made still carries the old resourceVersion
        core.replace_namespaced_config_map("spec", NS, made)
    assert status_of(stale.value)["reason"] == "Conflict"

    svc = core.create_namespaced_service(NS, client.V1Service(metadata=meta("rollout"), spec=client.V1ServiceSpec(
        selector={"app": "rollout"}, ports=[client.V1ServicePort(port=8000, target_port=8000)])))
    assert svc.spec.cluster_ip and svc.spec.type == "ClusterIP"
    deploy = apps.create_namespaced_deployment(NS, deployment("rollout"))
    assert (deploy.kind, deploy.api_version, deploy.metadata.generation) == ("Deployment", "apps/v1", 1)
    assert core.patch_namespaced_config_map("spec", NS, {"data": {"more": "4"}}).data == {"k": "3", "more": "4"}
    with pytest.raises(ApiException) as strategic:  # a Deployment's lists merge by key: not emulated, so refused
        apps.patch_namespaced_deployment("rollout", NS, {"spec": {"replicas": 1}})
    assert strategic.value.status == 415
    scaled = apps.patch_namespaced_deployment("rollout", NS, {"spec": {"replicas": 1}},
                                              _content_type="application/merge-patch+json")
    assert (scaled.metadata.generation, scaled.status.ready_replicas) == (2, 1)

    rbac = client.RbacAuthorizationV1Api(core.api_client)
    rbac.create_namespaced_role(NS, client.V1Role(metadata=meta("reader"), rules=[client.V1PolicyRule(
        api_groups=[""], resources=["pods"], verbs=["get"])]))
    assert rbac.read_namespaced_role("reader", NS).rules[0].verbs == ["get"]  # stored, validated; grants nothing

    dry = core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=client.V1ObjectMeta(generate_name="run-")),
                                            dry_run="All")
    assert dry.metadata.name.startswith("run-") and len(dry.metadata.name) == 9
    assert fake_kube.get("ConfigMap", dry.metadata.name) is None  # validated, named, not stored

    core.delete_namespaced_config_map("spec", NS)
    core.delete_namespaced_service("rollout", NS, body=client.V1DeleteOptions(propagation_policy="Background"))
    for read, name in ((core.read_namespaced_config_map, "spec"), (core.read_namespaced_service, "rollout")):
        with pytest.raises(ApiException) as gone:
            read(name, NS)
        assert (gone.value.status, status_of(gone.value)["reason"]) == (404, "NotFound")

    posts = [r for r in fake_kube.requests if r.method == "POST"]
    assert posts[0].path == f"/api/v1/namespaces/{NS}/configmaps" and posts[0].body["data"] == {"k": "1"}
    assert ("GET", f"/api/v1/namespaces/{NS}/configmaps", {"labelSelector": "app=a"}) in [
        (r.method, r.path, r.query) for r in fake_kube.requests]


def deployment(name: str, replicas: int = 2) -> client.V1Deployment:
    pod = client.V1PodSpec(containers=[client.V1Container(name="server", image="vllm:test")])
    return client.V1Deployment(metadata=meta(name), spec=client.V1DeploymentSpec(
        replicas=replicas, selector=client.V1LabelSelector(match_labels={"app": name}),
        template=client.V1PodTemplateSpec(metadata=meta("", app=name), spec=pod)))


def test_invalid_objects_get_422_naming_the_field_and_are_not_stored(fake_kube: FakeKube, apis) -> None:
    _, apps, batch = apis
    body = client.ApiClient().sanitize_for_serialization(deployment("typo"))
    body["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1  # a plausible typo, not a Kubernetes field
    with pytest.raises(ApiException) as bad:
        apps.create_namespaced_deployment(NS, body)
    status = status_of(bad.value)
    assert (bad.value.status, status["reason"]) == (422, "Invalid")
    assert "gpus" in status["message"] and status["details"]["causes"][0]["field"] == "spec.template.spec.containers.0"
    assert fake_kube.get("Deployment", "typo") is None

    always = job("always", [sys.executable, "-c", "pass"])
    always.spec.template.spec.restart_policy = "Always"  # schema-valid, but a Job's pods must not restart forever
    with pytest.raises(ApiException) as restart:
        batch.create_namespaced_job(NS, always)
    assert restart.value.status == 422 and "restartPolicy" in status_of(restart.value)["message"]
    assert fake_kube.runs == []


def test_deployments_are_ready_unless_told_otherwise(fake_kube: FakeKube, apis) -> None:
    _, apps, _ = apis
    ready = apps.create_namespaced_deployment(NS, deployment("fast"))
    assert (ready.status.ready_replicas, ready.status.available_replicas) == (2, 2)
    assert [(c.type, c.status) for c in ready.status.conditions][0] == ("Available", "True")

    fake_kube.set_ready("slow", False)
    apps.create_namespaced_deployment(NS, deployment("slow", replicas=3))
    slow = apps.read_namespaced_deployment("slow", NS)
    assert slow.status.ready_replicas is None and slow.status.unavailable_replicas == 3
    assert {c.type: c.status for c in slow.status.conditions}["Available"] == "False"
    fake_kube.set_ready("slow")
    now = apps.read_namespaced_deployment("slow", NS)
    assert now.status.ready_replicas == 3 and {c.type: c.status for c in now.status.conditions}["Available"] == "True"


def test_indexed_job_runs_each_index_as_a_process_with_its_env_args_and_files(fake_kube: FakeKube, apis,
                                                                               tmp_path: Path) -> None:
    core, _, batch = apis
    fake_kube.add_node("gpu-a", {"pool": "gpu"})
    fake_kube.add_node("cpu-a", {"pool": "cpu"})
    fake_kube.path_map.update({"/etc/factory": str(tmp_path / "etc"), "/data": str(tmp_path / "data")})
    fake_kube.extra_env["FROM_TEST"] = "yes"
    core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("spec"), data={"spec.yaml": "seed: 7\n"}))
    script = ("import os, sys; print(sys.argv[1:]); print(open(os.environ['SPEC']).read().strip()); "
              "print(*(os.environ[k] for k in ('RANK', 'POD', 'NS', 'NODE', 'JOB_COMPLETION_INDEX', 'FROM_TEST')))")

    def field(path: str) -> client.V1EnvVarSource:
        return client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path=path))
    env = [client.V1EnvVar(name="RANK", value_from=field("metadata.annotations['batch.kubernetes.io/job-completion-"
                                                         "index']")),
           client.V1EnvVar(name="POD", value_from=field("metadata.name")),
           client.V1EnvVar(name="NS", value_from=field("metadata.namespace")),
           client.V1EnvVar(name="NODE", value_from=field("spec.nodeName")),
           client.V1EnvVar(name="SPEC", value="/etc/factory/spec.yaml")]
    created = batch.create_namespaced_job(NS, job(
        "train", [sys.executable, "-c", script, "--node-rank=$(RANK)", "--out=/data/run", "$$(RANK)"], completions=2,
        env=env, node_selector={"pool": "gpu"}, mounts=[client.V1VolumeMount(name="spec", mount_path="/etc/factory")],
        volumes=[client.V1Volume(name="spec", config_map=client.V1ConfigMapVolumeSource(name="spec"))]))
    assert created.spec.selector.match_labels["batch.kubernetes.io/controller-uid"] == created.metadata.uid

    done = fake_kube.wait_job("train")
    assert [c["type"] for c in done["status"]["conditions"]] == ["SuccessCriteriaMet", "Complete"]
    assert (done["status"]["succeeded"], done["status"]["completedIndexes"], done["status"]["active"]) == (2, "0-1", 0)
    assert done["status"]["completionTime"] and done["status"]["startTime"]
    job_read = batch.read_namespaced_job("train", NS)
    assert job_read.status.succeeded == 2 and job_read.status.completion_time is not None

    pods = core.list_namespaced_pod(NS, label_selector="job-name=train,app=factory").items
    assert len(pods) == 2
    for pod in sorted(pods, key=lambda p: p.metadata.annotations["batch.kubernetes.io/job-completion-index"]):
        index = pod.metadata.annotations["batch.kubernetes.io/job-completion-index"]
        assert re.fullmatch(rf"train-{index}-[a-z0-9]{{5}}", pod.metadata.name)
        assert pod.metadata.labels["batch.kubernetes.io/job-name"] == "train"
        assert pod.metadata.labels["batch.kubernetes.io/job-completion-index"] == index
        assert pod.metadata.owner_references[0].uid == created.metadata.uid
        assert (pod.status.phase, pod.spec.node_name) == ("Succeeded", "gpu-a")
        assert pod.status.container_statuses[0].state.terminated.exit_code == 0
        log = core.read_namespaced_pod_log(pod.metadata.name, NS, timestamps=True, _preload_content=False).data
        lines = log.decode().splitlines()
        assert all(re.match(STAMP + " ", line) for line in lines)
        assert [line.split(" ", 1)[1] for line in lines] == [
            str([f"--node-rank={index}", f"--out={tmp_path}/data/run", "$(RANK)"]), "seed: 7",
            f"{index} {pod.metadata.name} {NS} gpu-a {index} yes"]
        run = fake_kube.run_of(pod.metadata.name)
        assert run.returncode == 0 and run.env["HOSTNAME"] == pod.metadata.name and run.cwd == str(fake_kube.workdir)
    assert (tmp_path / "etc" / "spec.yaml").read_text() == "seed: 7\n"


def test_a_failing_pod_is_retried_until_the_backoff_limit_then_the_job_fails(fake_kube: FakeKube, apis) -> None:
    core, _, batch = apis
    batch.create_namespaced_job(NS, job("once", [sys.executable, "-c", "raise SystemExit(3)"], backoff=0))
    batch.create_namespaced_job(NS, job("twice", [sys.executable, "-c", "raise SystemExit(3)"], backoff=1))
    for name, pods in (("once", 1), ("twice", 2)):
        failed = fake_kube.wait_job(name)
        conditions = {c["type"]: c["reason"] for c in failed["status"]["conditions"]}
        assert conditions == {"FailureTarget": "BackoffLimitExceeded", "Failed": "BackoffLimitExceeded"}
        assert failed["status"]["failed"] == pods and "completionTime" not in failed["status"]
        listed = core.list_namespaced_pod(NS, label_selector=f"job-name={name}").items
        assert [p.status.phase for p in listed] == ["Failed"] * pods
        assert {p.status.container_statuses[0].state.terminated.exit_code for p in listed} == {3}
        assert core.list_namespaced_pod(NS, field_selector="status.phase=Failed", label_selector=f"job-name={name}"
                                        ).items == listed


def test_deleting_a_job_orphans_its_pods_unless_told_to_cascade(fake_kube: FakeKube, apis) -> None:
    core, _, batch = apis
    hold = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    for name in ("kept", "cascaded"):
        batch.create_namespaced_job(NS, job(name, hold))
    fake_kube.wait(lambda: len(fake_kube.runs) == 2 and all(r.lines for r in fake_kube.runs), what="both print up")
    kept, cascaded = (fake_kube.list("Pod", labels={"job-name": n})[0]["metadata"]["name"] for n in (
        "kept", "cascaded"))

    batch.delete_namespaced_job("kept", NS)  # batch/v1's default propagation is Orphan
    assert fake_kube.get("Job", "kept") is None
    orphan = core.read_namespaced_pod(kept, NS)
    assert orphan.status.phase == "Running" and not orphan.metadata.owner_references
    assert fake_kube.run_of(kept).returncode is None
    core.delete_namespaced_pod(kept, NS)
    fake_kube.wait(lambda: fake_kube.run_of(kept).returncode is not None, what="the deleted pod's process ends")

    batch.delete_namespaced_job("cascaded", NS, body=client.V1DeleteOptions(propagation_policy="Background"))
    assert core.list_namespaced_pod(NS, label_selector="job-name=cascaded").items == []
    fake_kube.wait(lambda: fake_kube.run_of(cascaded).returncode is not None, what="the job's process ends")
    # killed: SIGTERM first, as a kubelet sends it, then SIGKILL after the grace period. In the full suite (2 cores,
    # 1000+ tests in one process) the process was twice seen ending by SIGKILL; the cause is not pinned down, so
    # either signal passes here and the process must not have exited by itself or kept running.
    assert fake_kube.run_of(cascaded).returncode in KILLED


def test_env_sources_working_dir_and_mount_items(fake_kube: FakeKube, apis, tmp_path: Path) -> None:
    core, _, batch = apis
    fake_kube.path_map["/job"] = str(tmp_path / "work")  # not /work: this checkout's python lives under /work
    (tmp_path / "work").mkdir()
    core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("settings"),
                                                             data={"lr": "0.1", "steps": "5", "unused": "x"}))
    env = [client.V1EnvVar(name="STEPS", value_from=client.V1EnvVarSource(
               config_map_key_ref=client.V1ConfigMapKeySelector(name="settings", key="steps"))),
           client.V1EnvVar(name="PLAN", value="$(CFG_lr)x$(STEPS)")]  # expands against the variables before it
    script = "import os; print(os.getcwd(), os.environ['CFG_lr'], os.environ['PLAN'], sorted(os.listdir('lr-only')))"
    body = job("env", [sys.executable, "-c", script], env=env, mounts=[
        client.V1VolumeMount(name="cfg", mount_path="/job/lr-only")], volumes=[client.V1Volume(
            name="cfg", config_map=client.V1ConfigMapVolumeSource(name="settings", items=[
                client.V1KeyToPath(key="lr", path="rate")]))])
    container = body.spec.template.spec.containers[0]
    container.env_from = [client.V1EnvFromSource(prefix="CFG_", config_map_ref=client.V1ConfigMapEnvSource(
        name="settings"))]
    container.working_dir = "/job"
    batch.create_namespaced_job(NS, body)
    assert fake_kube.wait_job("env")["status"]["succeeded"] == 1
    assert fake_kube.runs[0].output() == f"{tmp_path}/work 0.1 0.1x5 ['rate']\n"


def test_an_image_entrypoint_cluster_names_and_empty_dirs_stand_in_for_the_container(fake_kube: FakeKube, apis,
                                                                                       tmp_path: Path) -> None:
    _, _, batch = apis
    fake_kube.entrypoints["registry.example.com/factory:0.1.0"] = [sys.executable]  # as if ENTRYPOINT ["python"]
    fake_kube.hosts["train-0.train.factory.svc"] = "127.0.0.1"
    fake_kube.path_map["/scratch"] = str(tmp_path / "scratch")
    script = "import os, sys; print(sys.argv[1:], os.environ['SANDBOX'], os.path.isdir(os.environ['S']))"
    body = job("entry", [sys.executable, "-c", script, "--master-addr=train-0.train.factory.svc", "--scratch=/scratch"],
               env=[client.V1EnvVar(name="SANDBOX", value="http://train-0.train.factory.svc:8200"),
                    client.V1EnvVar(name="S", value="/scratch")],
               mounts=[client.V1VolumeMount(name="scratch", mount_path="/scratch")],
               volumes=[client.V1Volume(name="scratch", empty_dir=client.V1EmptyDirVolumeSource())])
    container = body.spec.template.spec.containers[0]
    container.image, container.args, container.command = "registry.example.com/factory:0.1.0", container.command[1:] + \
        container.args, None
    batch.create_namespaced_job(NS, body)
    assert fake_kube.wait_job("entry")["status"]["succeeded"] == 1
    assert fake_kube.runs[0].output() == f"['--master-addr=127.0.0.1', '--scratch={tmp_path}/scratch'] " \
        "http://127.0.0.1:8200 True\n"


def test_a_job_past_its_active_deadline_is_failed_and_its_pods_killed(fake_kube: FakeKube, apis) -> None:
    _, _, batch = apis
    body = job("slow", [sys.executable, "-c", "import time; time.sleep(60)"])
    body.spec.active_deadline_seconds = 1
    batch.create_namespaced_job(NS, body)
    failed = fake_kube.wait_job("slow")
    assert {c["type"]: c["reason"] for c in failed["status"]["conditions"]}["Failed"] == "DeadlineExceeded"
    fake_kube.wait(lambda: fake_kube.runs[0].returncode is not None, what="the pod's process killed")
    assert fake_kube.runs[0].returncode in KILLED


def test_a_non_indexed_job_runs_its_completions_one_at_a_time(fake_kube: FakeKube, apis) -> None:
    core, _, batch = apis
    body = job("plain", [sys.executable, "-c", "import os; print(os.environ.get('JOB_COMPLETION_INDEX'))"])
    body.spec.completions = 3
    batch.create_namespaced_job(NS, body)
    done = fake_kube.wait_job("plain")
    assert done["status"]["succeeded"] == 3 and "completedIndexes" not in done["status"]
    pods = core.list_namespaced_pod(NS, label_selector="job-name=plain").items
    assert len(pods) == 3 and all(re.fullmatch(r"plain-[a-z0-9]{5}", p.metadata.name) for p in pods)
    assert all(p.metadata.annotations is None for p in pods) and {r.output() for r in fake_kube.runs} == {"None\n"}



def test_what_a_container_leaves_running_dies_with_it(fake_kube: FakeKube, apis) -> None:
    _, _, batch = apis
    script = ("import subprocess, sys; sleeper = [sys.executable, '-c', 'import time; time.sleep(60)']; "
              "print(subprocess.Popen(sleeper).pid, flush=True)")
    batch.create_namespaced_job(NS, job("leaves", [sys.executable, "-c", script]))
    assert fake_kube.wait_job("leaves")["status"]["succeeded"] == 1  # not 60 s: the child held the log pipe
    assert exits_within(int(fake_kube.runs[0].output()), 10)  # it would sleep 60 s


def test_followed_logs_stream_lines_as_the_process_writes_them(fake_kube: FakeKube, apis, tmp_path: Path) -> None:
    core, _, batch = apis
    gate = tmp_path / "gate"
    os.mkfifo(gate)  # the process waits on it until the test has seen its first line: ordering, not timing
    held = os.open(gate, os.O_RDWR)  # read-write: neither side's open blocks, and the process's read waits for data
    fake_kube.path_map["/gate"] = str(gate)
    script = "import sys; gate = open(sys.argv[1]); print('first', flush=True); gate.readline(); print('second')"
    batch.create_namespaced_job(NS, job("talk", [sys.executable, "-c", script, "/gate"]))
    fake_kube.wait(lambda: any(r.started for r in fake_kube.runs), what="the pod starts")
    pod = fake_kube.runs[0].pod

    stream = core.read_namespaced_pod_log(pod, NS, follow=True, timestamps=True, container="main",
                                          _preload_content=False, _request_timeout=20)
    chunks = stream.stream()
    first = next(chunks).decode()
    assert re.fullmatch(STAMP + " first\n", first)
    os.write(held, b"go\n")
    os.close(held)
    rest = b"".join(chunks).decode()
    assert re.fullmatch(STAMP + " second\n", rest)  # and the stream ended because the process exited
    assert first.split()[0] < rest.split()[0]

    assert core.read_namespaced_pod_log(pod, NS, tail_lines=1, _preload_content=False).data == b"second\n"
    assert core.read_namespaced_pod_log(pod, NS, since_seconds=3600, _preload_content=False).data == b"first\nsecond\n"
    with pytest.raises(ApiException) as wrong:
        core.read_namespaced_pod_log(pod, NS, container="sidecar")
    assert wrong.value.status == 400


@pytest.mark.slow
def test_node_patches_merge_labels_and_replace_taints_and_taints_keep_pods_off(fake_kube: FakeKube, apis) -> None:
    core, _, batch = apis
    fake_kube.add_node("gpu-a", {"pool": "gpu"})
    assert core.read_node("gpu-a").metadata.labels == {"kubernetes.io/hostname": "gpu-a", "pool": "gpu"}
    taint = {"key": "factory.dev/failing", "value": "nccl", "effect": "NoSchedule"}
    core.patch_node("gpu-a", {"metadata": {"labels": {"factory.dev/failing": "true"}}, "spec": {"taints": [taint]}})
    node = fake_kube.node("gpu-a")
    assert node["metadata"]["labels"] == {"kubernetes.io/hostname": "gpu-a", "pool": "gpu",
                                          "factory.dev/failing": "true"}
    assert node["spec"]["taints"] == [taint]
    assert fake_kube.requests[-1].content_type == "application/strategic-merge-patch+json"

    other = {"key": "factory.dev/drain", "effect": "NoExecute"}
    core.patch_node("gpu-a", {"spec": {"taints": [other]}}, _content_type="application/merge-patch+json")
    core.patch_node("gpu-a", [{"op": "remove", "path": "/metadata/labels/factory.dev~1failing"}])  # a json-patch
    node = fake_kube.node("gpu-a")
    assert node["spec"]["taints"] == [other] and "factory.dev/failing" not in node["metadata"]["labels"]
    with pytest.raises(ApiException) as bad:
        core.patch_node("gpu-a", {"metadata": {"labels": {"pool": 7}}})  # label values are strings
    assert bad.value.status == 422 and fake_kube.node("gpu-a")["metadata"]["labels"]["pool"] == "gpu"

    batch.create_namespaced_job(NS, job("shunned", [sys.executable, "-c", "pass"], node_selector={"pool": "gpu"}))
    fake_kube.wait(lambda: bool(fake_kube.list("Pod")), what="the pod is made")
    pod = core.list_namespaced_pod(NS).items[0]
    assert pod.status.phase == "Pending" and pod.spec.node_name is None
    assert pod.status.conditions[0].reason == "Unschedulable"
    with pytest.raises(ApiException) as waiting:
        core.read_namespaced_pod_log(pod.metadata.name, NS)
    assert waiting.value.status == 400 and "waiting to start" in status_of(waiting.value)["message"]


def test_a_container_that_cannot_start_fails_its_pod_with_the_reason(fake_kube: FakeKube, apis) -> None:
    core, _, batch = apis
    core.create_namespaced_config_map(NS, client.V1ConfigMap(metadata=meta("spec"), data={"a": "b"}))
    batch.create_namespaced_job(NS, job(
        "unmapped", [sys.executable, "-c", "pass"], mounts=[client.V1VolumeMount(name="spec", mount_path="/etc/x")],
        volumes=[client.V1Volume(name="spec", config_map=client.V1ConfigMapVolumeSource(name="spec"))]))
    no_entry = job("no-entry", [sys.executable, "-c", "pass"])
    no_entry.spec.template.spec.containers[0].command = None  # and fake_kube.entrypoints knows no image
    batch.create_namespaced_job(NS, no_entry)
    for name, reason in (("unmapped", "no path_map entry covers the container path /etc/x"),
                         ("no-entry", "no command and entrypoints has no entry for 'factory:test'")):
        assert fake_kube.wait_job(name)["status"]["failed"] == 1
        (pod,) = core.list_namespaced_pod(NS, label_selector=f"job-name={name}").items
        terminated = pod.status.container_statuses[0].state.terminated
        assert (pod.status.phase, terminated.reason, terminated.exit_code) == ("Failed", "StartError", 128)
        assert reason in terminated.message


def test_expansion_and_path_mapping_follow_kubernetes_rules() -> None:
    env = {"RANK": "3", "DIR": "/data"}
    assert expand("--rank=$(RANK) $(MISSING) $$(RANK) $$ $(DIR)/x", env) == "--rank=3 $(MISSING) $(RANK) $ /data/x"
    mapping = {"/data": "/tmp/d", "/data/ckpt": "/tmp/c"}
    assert map_paths("--in=/data/a --ck=/data/ckpt/b /database /x/data", mapping) == \
        "--in=/tmp/d/a --ck=/tmp/c/b /database /x/data"
    machine = Machine(Path("/w"), path_map={"/data": "/tmp/d"}, hosts={"a.svc": "127.0.0.1"})
    assert machine.rewrite("http://a.svc:80/data a.svc.cluster.local xa.svc a.svc /data/f") == \
        "http://127.0.0.1:80/data a.svc.cluster.local xa.svc 127.0.0.1 /tmp/d/f"  # a URL's path is not a local path


PIPES_SCRIPT = """
import os
from dagster_pipes import open_dagster_pipes

with open_dagster_pipes() as pipes:
    pipes.log.info("hello from the pod")
    print("plain output is forwarded, not parsed")
    pipes.report_asset_materialization(metadata={
        "rank": int(os.environ["JOB_COMPLETION_INDEX"]), "lr": pipes.get_extra("lr"), "pod": os.environ["HOSTNAME"]})
"""


def test_dagster_pipes_reads_the_materialization_from_the_job_pods_logs(fake_kube: FakeKube, apis,
                                                                         tmp_path: Path) -> None:
    core, _, batch = apis
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "report.py").write_text(textwrap.dedent(PIPES_SCRIPT))
    fake_kube.path_map["/app"] = str(tmp_path / "app")

    @dg.asset
    def trained(context):  # no annotation: dagster checks it at runtime and these are strings here
        reader = PipesK8sPodLogsMessageReader()
        with dg.open_pipes_session(context, extras={"lr": 0.5}, context_injector=dg.PipesEnvContextInjector(),
                                   message_reader=reader) as session:
            env = [client.V1EnvVar(name=k, value=v) for k, v in session.get_bootstrap_env_vars().items()]
            batch.create_namespaced_job(NS, job("pipes", [sys.executable, "/app/report.py"], completions=1, env=env))
            fake_kube.wait(lambda: any(r.started for r in fake_kube.runs), what="the pipes pod starts")
            reader.consume_pod_logs(context, core, fake_kube.runs[0].pod, NS)
        yield from session.get_results()

    result = dg.materialize([trained])
    assert result.success
    materialized = result.asset_materializations_for_node("trained")[0].metadata
    assert materialized["rank"].value == 0 and materialized["lr"].value == 0.5
    assert materialized["pod"].value == fake_kube.runs[0].pod
    assert fake_kube.wait_job("pipes")["status"]["succeeded"] == 1


def test_watch_status_subresource_and_dagster_k8s_job_client(fake_kube: FakeKube, apis, tmp_path: Path) -> None:
    core, _, batch = apis
    created = batch.create_namespaced_job(NS, job("ok", [sys.executable, "-c", "print('fine')"]))
    batch.create_namespaced_job(NS, job("bad", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]))
    seen = []  # from the creation's resourceVersion on: every change, however fast the job ran
    for event in watch.Watch().stream(batch.list_namespaced_job, NS, field_selector="metadata.name=ok",
                                      resource_version=created.metadata.resource_version, timeout_seconds=20):
        seen.append((event["type"], event["object"].metadata.name, event["object"].status.succeeded))
        if any(c.type == "Complete" for c in event["object"].status.conditions or []):
            break
    assert seen[0][0] == "MODIFIED" and seen[-1] == ("MODIFIED", "ok", 1) and {s[1] for s in seen} == {"ok"}
    fake_kube.wait_job("bad")
    listed = watch.Watch().stream(core.list_namespaced_pod, NS, label_selector="job-name=bad", timeout_seconds=20)
    first = next(listed)  # without a resourceVersion: what exists now, as ADDED
    assert (first["type"], first["object"].status.phase) == ("ADDED", "Failed")
    listed.close()
    assert batch.read_namespaced_job_status("ok", NS).status.succeeded == 1

    def no_sleeping(seconds: float) -> None:
        raise AssertionError(f"dagster-k8s polled again ({seconds}s): the fake's status did not satisfy it")
    k8s = DagsterKubernetesClient(batch, core, logger=lambda _msg: None, sleeper=no_sleeping, timer=time.monotonic)
    k8s.wait_for_job_success("ok", NS)
    (ok_pod,) = k8s.get_pod_names_in_job("ok", NS)
    k8s.wait_for_pod(ok_pod, NS, wait_for_state=WaitForPodState.Terminated)
    fake_kube.wait_job("bad")
    (bad_pod,) = k8s.get_pod_names_in_job("bad", NS)
    with pytest.raises(DagsterK8sError, match="Container \"main\" failed") as failed:
        k8s.wait_for_pod(bad_pod, NS, wait_for_state=WaitForPodState.Terminated)
    assert 'Last 100 log lines: "boom\n"' in str(failed.value)  # read back through tailLines

    kubeconfig = fake_kube.write_kubeconfig(tmp_path / "kubeconfig")
    configured = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=configured)
    with client.ApiClient(configured) as api:
        assert {j.metadata.name for j in client.BatchV1Api(api).list_namespaced_job(NS).items} == {"ok", "bad"}
