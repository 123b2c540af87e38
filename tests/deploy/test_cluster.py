"""Launching a GRPO run on a cluster (factory/deploy/cluster.py, resources/launch.py) against the fake Kubernetes API
server (tests/deploy/fake_kube.py): no API server can run on these machines, so the fake answers the official client
over real HTTP, validates every body strictly against the Kubernetes 1.37 schemas, and runs the trainer Job's command
as a local process. What is shown: the order of objects (services ready before trainers), cleanup whatever the
outcome, exit codes, and the `grpo_run` asset trained by `factory train-grpo` in a "pod" reporting through Pipes
over its log, with the same metadata as in the asset's process. What is not: images, scheduling, NCCL, real pods."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from dagster import DagsterInstance, materialize

from factory.config import apply_overrides, load_spec, parse_overrides
from factory.deploy import cluster as cl
from factory.deploy.manifests import LAUNCHER_RULES
from factory.deploy.profile import DeployProfile
from jobs import QUICKSTART_ASSETS, make_resources
from resources import TrainingLauncherResource
from tests.deploy.fake_kube import FakeKube
from tests.jobs.test_training_launch import GRPO_METADATA, SPEC, TINY

ROOT = Path(__file__).resolve().parents[2]
NS = "factory"
# A CPU cluster with no PVC and no env Secret (the fake has neither), in the namespace the objects name.
PROFILE = DeployProfile(namespace=NS, gpus_per_train_pod=0, checkpoint_pvc=None, env_secret=None)
SCRIPT = "import os, sys; print('rank0 says hi', flush=True); sys.exit(int(os.environ.get('EXIT', '0')))"


def no_entrypoint(objs: cl.RunObjects) -> cl.RunObjects:
    """The image's ENTRYPOINT (tini --) does not exist here: run the container's args as its command."""
    for obj in [objs.train_job, *objs.services]:
        if obj["kind"] in ("Job", "Deployment"):
            for c in obj["spec"]["template"]["spec"]["containers"]:
                if "args" in c:
                    c["command"] = c.pop("args")
    return objs


def code_spec():
    # examples/k8s.yaml: a sandbox pool and two SGLang servers; one trainer rank so the pod runs one process
    return apply_overrides(load_spec(ROOT / "examples" / "k8s.yaml"), {"trainer.world_size": 1})


def scripted_objects(exit_code: int = 0) -> cl.RunObjects:
    objs = no_entrypoint(cl.run_objects(code_spec(), PROFILE, {"EXIT": str(exit_code)}))
    objs.train_job["spec"]["template"]["spec"]["containers"][0]["command"] = [sys.executable, "-c", SCRIPT]
    return objs


@pytest.fixture
def cluster(fake_kube: FakeKube, tmp_path: Path) -> cl.Cluster:
    fake_kube.path_map.update({"/etc/factory": str(tmp_path / "spec"), "/data": str(tmp_path / "data")})
    return cl.Cluster(fake_kube.api_client(), NS, poll_s=0.02)


def created_kinds(fake: FakeKube) -> list[str]:
    return [f"{r.body['kind']}/{r.body['metadata']['name']}" for r in fake.requests
            if r.method == "POST" and isinstance(r.body, dict) and "kind" in r.body]


def rbac_needed(fake: FakeKube) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of every request the launch made, as the API server's authorizer sees them."""
    out = set()
    for r in fake.requests:
        parts = r.path.strip("/").split("/")
        group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
        assert rest[0] == "namespaces" and rest[1] == NS, r.path  # nothing cluster-wide
        resource, named = "/".join([rest[2], *rest[4:5]]), len(rest) > 3
        verb = {"POST": "create", "PUT": "update", "DELETE": "delete", "PATCH": "patch"}.get(
            r.method, "get" if named else "list")
        out.add((group, resource, verb))
    return out


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
               for rule in LAUNCHER_RULES)


def left_behind(fake: FakeKube) -> list[str]:
    return [f"{k}/{o['metadata']['name']}" for k in ("ConfigMap", "Service", "Deployment", "Job")
            for o in fake.list(k, NS)]


@pytest.mark.slow
def test_services_are_ready_before_the_trainers_start_and_everything_is_deleted_after(fake_kube: FakeKube,
                                                                                      cluster: cl.Cluster) -> None:
    followed: list[str] = []
    objs = scripted_objects()
    outcome = cl.launch_run(cluster, objs, followed.append, ready_timeout_s=30, run_timeout_s=60)
    assert outcome == cl.JobOutcome(succeeded=True, exit_code=0, reason=outcome.reason)
    made = created_kinds(fake_kube)
    assert made == ["ConfigMap/k8s-code-grpo-spec",
                    "Deployment/k8s-code-grpo-sandbox", "Service/k8s-code-grpo-sandbox",
                    "Deployment/k8s-code-grpo-sglang-0", "Service/k8s-code-grpo-sglang-0",
                    "Deployment/k8s-code-grpo-sglang-1", "Service/k8s-code-grpo-sglang-1",
                    "Service/k8s-code-grpo-train", "Job/k8s-code-grpo-train"]
    # the rollout servers' readiness was read before the trainer Job was created
    job_post = next(i for i, r in enumerate(fake_kube.requests) if r.method == "POST" and r.path.endswith("/jobs"))
    read_first = {r.path.rsplit("/", 1)[1] for r in fake_kube.requests[:job_post]
                  if r.method == "GET" and "/deployments/" in r.path}
    assert read_first == {"k8s-code-grpo-sandbox", "k8s-code-grpo-sglang-0", "k8s-code-grpo-sglang-1"}
    assert followed == [fake_kube.runs[0].pod] and "rank0 says hi" in fake_kube.runs[0].output()
    assert left_behind(fake_kube) == []


@pytest.mark.slow
def test_a_trainer_that_exits_4_is_reported_and_nothing_is_left_behind(fake_kube: FakeKube, cluster: cl.Cluster
                                                                        ) -> None:
    outcome = cl.launch_run(cluster, scripted_objects(exit_code=4), lambda pod: None, 30, 60)
    assert (outcome.succeeded, outcome.exit_code) == (False, 4)
    assert left_behind(fake_kube) == []


@pytest.mark.slow
def test_rollout_servers_that_never_get_ready_are_named_and_cleaned_up(fake_kube: FakeKube, cluster: cl.Cluster
                                                                        ) -> None:
    for i in range(2):
        fake_kube.set_ready(f"k8s-code-grpo-sglang-{i}", False, namespace=NS)
    with pytest.raises(cl.ClusterError, match="rollout servers to be ready; not ready: k8s-code-grpo-sglang-0, "
                                              "k8s-code-grpo-sglang-1$"):  # the sandbox pool was ready
        cl.launch_run(cluster, scripted_objects(), lambda pod: None, ready_timeout_s=0.3, run_timeout_s=60)
    assert "Job/k8s-code-grpo-train" not in created_kinds(fake_kube)  # no trainer pods for servers that are not up
    assert left_behind(fake_kube) == []


@pytest.mark.slow
def test_trainer_pods_avoid_a_node_that_failed_preflight(fake_kube: FakeKube, cluster: cl.Cluster) -> None:
    # the only node is tainted by `factory preflight --mark-node` (factory/deploy/preflight.py): the trainer pod is
    # never scheduled, and the launch says which pod did not start
    from factory.ops.preflight.mark import TAINT_EFFECT, TAINT_KEY

    fake_kube.add_node("gpu-1", taints=[{"key": TAINT_KEY, "value": "failed", "effect": TAINT_EFFECT}])
    with pytest.raises(cl.ClusterError, match="pod 0 of Job k8s-code-grpo-train to start"):
        cl.launch_run(cluster, scripted_objects(), lambda pod: None, ready_timeout_s=0.5, run_timeout_s=60)
    assert left_behind(fake_kube) == []


@pytest.mark.slow
def test_a_leftover_job_of_an_earlier_launch_is_replaced(fake_kube: FakeKube, cluster: cl.Cluster) -> None:
    stale = scripted_objects()
    cluster.apply(stale.train_job)  # an orchestrator died and left its Job
    fake_kube.wait_job(stale.job_name, NS)
    outcome = cl.launch_run(cluster, scripted_objects(), lambda pod: None, 30, 60)
    assert outcome.succeeded and len(fake_kube.runs) == 2
    assert left_behind(fake_kube) == []
    assert [n for n in rbac_needed(fake_kube) if not allowed(*n)] == []  # replacing needs no more rights


@pytest.mark.slow
def test_the_grpo_run_asset_trains_in_a_pod_and_reports_through_pipes(fake_kube: FakeKube, tmp_path: Path,
                                                                      monkeypatch) -> None:
    data = tmp_path / "data"
    home = data / "factory"
    fake_kube.path_map.update({"/etc/factory": str(tmp_path / "spec"), "/data": str(data)})
    fake_kube.extra_env["PATH"] = f"{Path(sys.executable).parent}:/usr/bin:/bin"  # `factory` of this venv
    real = cl.run_objects
    monkeypatch.setattr(cl, "run_objects", lambda *a, **kw: no_entrypoint(real(*a, **kw)))
    profile = tmp_path / "deploy.yaml"
    profile.write_text(yaml.safe_dump(PROFILE.model_dump(mode="json")))
    launcher = TrainingLauncherResource(where="k8s", kubeconfig=str(fake_kube.write_kubeconfig(tmp_path / "kube")),
                                        deploy_profile=str(profile), poll_s=0.05, ready_timeout_s=60)
    resources = {**make_resources(SPEC, TINY, str(home)), "launcher": launcher}
    with DagsterInstance.ephemeral() as instance:
        result = materialize(QUICKSTART_ASSETS[:3], resources=resources, instance=instance)
    assert result.success
    md = result.asset_materializations_for_node("grpo_run")[0].metadata
    assert list(md) == GRPO_METADATA  # what the asset shows when it trains in its own process
    assert md["run_id"].value == f"pipes-{result.run_id[:8]}" and md["steps"].value == 4
    assert Path(md["checkpoint"].value).is_dir() and str(home) in md["checkpoint"].value
    # the launcher's Role (rendered by `factory deploy render`) allows every call the launch made, pod logs included
    needed = rbac_needed(fake_kube)
    assert ("", "pods/log", "get") in needed and [n for n in needed if not allowed(*n)] == []
    # one pod ran: a second means the step failed once and Dagster's retry hid it; say how the first one ended
    assert len(fake_kube.runs) == 1, [(r.pod, r.returncode, r.output()[-2000:]) for r in fake_kube.runs]
    run = fake_kube.runs[0]
    assert run.argv[1:] == ["train-grpo", str(tmp_path / "spec" / "spec.yaml")]
    assert run.returncode == 0 and "DAGSTER_PIPES_CONTEXT" in run.env
    # the pod's spec is the asset's spec, overrides applied (from the ConfigMap the launch created)
    pod_spec = load_spec(tmp_path / "spec" / "spec.yaml")
    assert pod_spec == apply_overrides(load_spec(SPEC), parse_overrides(TINY))
    assert left_behind(fake_kube) == []


def test_an_unreachable_cluster_is_named_and_not_retried() -> None:
    from dagster import Failure, build_asset_context

    from resources.launch import launch_k8s

    with pytest.raises(Failure, match="cannot reach the cluster \\(launcher.kubeconfig /nonexistent/kube\\)") as e:
        launch_k8s(build_asset_context(), code_spec(), TrainingLauncherResource(where="k8s",
                                                                                kubeconfig="/nonexistent/kube"), {})
    assert e.value.allow_retries is False
