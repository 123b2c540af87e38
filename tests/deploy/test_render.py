"""Rendering a spec's Kubernetes manifests (factory/deploy/): every manifest strictly valid against the schemas of
Kubernetes 1.37 (kubernetes-validate), snapshots of the whole output, GPUs / node pools / tolerations only where the
profile and spec put them, dagster-k8s's own run and step Jobs built from our tags, the sandbox pool locked down,
and the CLI. No API server: what would be sent to one is the boundary tested."""

from __future__ import annotations

import json
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from factory.cli import main
from factory.config import apply_overrides, load_spec
from factory.deploy.manifests import DAGSTER_CONFIG_TAG, RESTRICTED_CONTAINER
from factory.deploy.profile import DeployProfile, ProfileError, load_profile, parse_profile
from factory.deploy.render import RenderError, render, to_text, write_manifests

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = Path(__file__).parent / "snapshots"
K8S_VERSION = "1.37.0"
PROFILE = ROOT / "deploy" / "profile.example.yaml"
GPU = "nvidia.com/gpu"

CASES = {  # snapshot name: (spec, profile)
    "k8s": (ROOT / "examples" / "k8s.yaml", PROFILE),
    "quickstart": (ROOT / "examples" / "quickstart.yaml", None),
}


def rendered(case: str) -> dict[str, dict]:
    spec_path, profile_path = CASES[case]
    return render(load_spec(spec_path), load_profile(profile_path))


def pod_specs(obj: dict) -> list[dict]:
    return [obj["spec"]["template"]["spec"]] if obj["kind"] in ("Job", "Deployment") else []


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_is_strictly_valid_kubernetes(case: str) -> None:
    manifests = rendered(case)
    for name, obj in manifests.items():
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{case}/{name}: {e.message} at {'.'.join(map(str, e.path))}")
    assert len({(o["kind"], o["metadata"]["name"]) for o in manifests.values()}) == len(manifests)


def test_strict_validation_rejects_an_unknown_field() -> None:
    job = rendered("quickstart")["train-job.yaml"]
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1  # a plausible typo, not a Kubernetes field
    with pytest.raises(kubernetes_validate.ValidationError, match="gpus"):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_output_matches_snapshot(case: str) -> None:
    text = to_text(rendered(case))
    snapshot = SNAPSHOTS / f"{case}.yaml"
    if os.environ.get("FACTORY_UPDATE_SNAPSHOTS") == "1":
        snapshot.write_text(text)
    assert snapshot.is_file(), f"no snapshot {snapshot}: run with FACTORY_UPDATE_SNAPSHOTS=1"
    assert text == snapshot.read_text(), f"{case}: rendered manifests differ from {snapshot} (review, then " \
        "FACTORY_UPDATE_SNAPSHOTS=1 to accept)"


def gpus(pod: dict) -> int:
    res = pod["containers"][0]["resources"]
    assert res["requests"].get(GPU) == res["limits"].get(GPU)
    return int(res["limits"].get(GPU, 0))


def test_gpus_node_pools_and_tolerations_where_the_profile_says() -> None:
    manifests, profile = rendered("k8s"), load_profile(PROFILE)
    by_component: dict[str, list[dict]] = {}
    for obj in manifests.values():
        for pod in pod_specs(obj):
            labels = obj["metadata"]["labels"]
            role = labels.get("dagster/op") or labels["app.kubernetes.io/component"]  # dagster's: run_worker
            by_component.setdefault(role, []).append(pod)
    want = {"run_worker": (0, profile.eval), "train": (4, profile.train), "training": (4, profile.train),
            "rollout": (1, profile.rollout),
            "launcher": (0, profile.eval), "evals": (0, profile.eval), "sweeps": (0, profile.eval),
            "data": (0, profile.eval), "sandbox": (0, profile.sandbox)}
    assert set(by_component) == set(want)
    for role, pods in by_component.items():
        n, placement = want[role]
        for pod in pods:
            assert gpus(pod) == n, role
            assert pod.get("nodeSelector", {}) == placement.node_selector, role
            assert pod.get("tolerations", []) == [t.manifest() for t in placement.tolerations], role
    assert len(by_component["rollout"]) == 2  # one Deployment per server
    gpu_tolerations = [p for ps in by_component.values() for p in ps if any(t.get("key") == GPU
                                                                          for t in p.get("tolerations", []))]
    assert all(gpus(p) > 0 for p in gpu_tolerations)


def test_training_is_an_indexed_job_with_torchrun_from_the_spec() -> None:
    manifests = rendered("k8s")
    job, service = manifests["train-job.yaml"], manifests["train-service.yaml"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 2  # world_size 8 / 4 GPUs per pod
    pod = job["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert {"--nnodes=2", "--nproc-per-node=4", "--node-rank=$(NODE_RANK)"} <= set(args)
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert f"--master-addr=k8s-code-grpo-train-0.{service['metadata']['name']}.factory.svc" in args
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
    # the trainer reaches the rendered SGLang servers, one Service each, instead of starting its own
    spec_cm = yaml.safe_load(manifests["spec-configmap.yaml"]["data"]["spec.yaml"])
    assert spec_cm["rollout"]["sglang"]["urls"] == [
        f"http://k8s-code-grpo-sglang-{i}.factory.svc:30000" for i in range(2)]
    one_pod = render(apply_overrides(load_spec(CASES["k8s"][0]), {}), DeployProfile())["train-job.yaml"]
    assert one_pod["spec"]["parallelism"] == 1
    assert gpus(one_pod["spec"]["template"]["spec"]) == 8


def test_world_size_that_does_not_fill_pods_is_named() -> None:
    spec = apply_overrides(load_spec(CASES["k8s"][0]), {"trainer.world_size": 6})
    with pytest.raises(RenderError, match="trainer.world_size: 6 ranks .* gpus_per_train_pod = 4"):
        render(spec, load_profile(PROFILE))


@pytest.mark.parametrize("mode", ["disk", "distributed"])
def test_weight_updates_that_cannot_leave_the_trainer_pod_are_refused(mode: str) -> None:
    spec = apply_overrides(load_spec(CASES["k8s"][0]), {"rollout.sglang.weight_update": mode})
    with pytest.raises(RenderError, match=f"rollout.sglang.weight_update: .* only 'tensor' .*got '{mode}'"):
        render(spec, load_profile(PROFILE))


def test_rollout_servers_listen_on_the_pod_address() -> None:
    manifests = rendered("k8s")
    for i in range(2):
        container = manifests[f"rollout-{i}-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
        argv = container["command"]
        assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
        assert argv[argv.index("--host") + 1] == "0.0.0.0"
        assert argv[argv.index("--base-gpu-id") + 1] == "0"  # the pod sees only its own GPU
        assert manifests[f"rollout-{i}-service.yaml"]["spec"]["selector"]["factory/server"] == str(i)
    assert not any(name.startswith(("rollout-", "sandbox-")) for name in rendered("quickstart"))
    tp2 = render(apply_overrides(load_spec(CASES["k8s"][0]), {"rollout.sglang.tp_size": 2}), load_profile(PROFILE))
    pod = tp2["rollout-1-deployment.yaml"]["spec"]["template"]["spec"]
    assert gpus(pod) == 2 and "--tp-size" in (argv := pod["containers"][0]["command"])
    assert argv[argv.index("--tp-size") + 1] == "2"


def test_sandbox_pods_are_locked_down() -> None:
    pod = rendered("k8s")["sandbox-deployment.yaml"]["spec"]["template"]["spec"]
    ctx = pod["containers"][0]["securityContext"]
    assert ctx == RESTRICTED_CONTAINER
    assert ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
    assert ctx["capabilities"] == {"drop": ["ALL"]} and ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsUser"] != 0
    assert "--size" in (args := pod["containers"][0]["args"]) and args[args.index("--size") + 1] == "8"


def test_dagster_k8s_step_jobs_carry_our_tags() -> None:
    manifests = rendered("k8s")
    tags = {group: json.loads(data) for group, data in (
        (name.removesuffix(".json"), d) for name, d in manifests["dagster-tags-configmap.yaml"]["data"].items())}
    assert set(tags) == {"run", "training", "launcher", "evals", "sweeps", "data"}
    for group, config in tags.items():
        job = manifests["dagster-run-job.yaml" if group == "run" else f"dagster-step-{group}-job.yaml"]
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        # dagster-k8s built these (its labels, its container name, its DAGSTER_HOME) from our tag's resources
        assert job["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dagster" and container["name"] == "dagster"
        assert {"name": "DAGSTER_HOME", "value": "/opt/dagster/dagster_home"} in container["env"]
        assert container["resources"] == config["container_config"]["resources"]
        assert pod.get("nodeSelector", {}) == config["pod_spec_config"].get("nodeSelector", {})
    assert int(tags["training"]["container_config"]["resources"]["limits"][GPU]) == 4
    for group in ("run", "launcher", "evals", "sweeps", "data"):
        assert GPU not in tags[group]["container_config"]["resources"]["limits"], group
    assert manifests["dagster-run-job.yaml"]["metadata"]["labels"]["app.kubernetes.io/component"] == "run_worker"


def test_dagster_k8s_rejects_a_malformed_tag() -> None:
    from dagster_k8s.job import get_user_defined_k8s_config

    with pytest.raises(Exception, match=DAGSTER_CONFIG_TAG):
        get_user_defined_k8s_config({DAGSTER_CONFIG_TAG: json.dumps({"container_confg": {}})})


def test_profile_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ProfileError) as e:
        parse_profile({"train": {"tolerations": [{"effect": "NoScedule"}], "cpu": "lots"}, "shm": "1Gi"})
    text = str(e.value)
    assert "train.tolerations.0.effect" in text and "train.cpu: expected a Kubernetes quantity" in text
    assert "shm: unknown key" in text
    bad = tmp_path / "deploy.yaml"
    bad.write_text("namespace: Factory_NS\n")
    with pytest.raises(ProfileError, match=f"{bad}.*\n  namespace: expected a DNS label"):
        load_profile(bad)


def test_cli_writes_the_files_and_refuses_a_non_empty_out(tmp_path: Path, capsys) -> None:
    out = tmp_path / "manifests"
    argv = ["deploy", "render", str(CASES["k8s"][0]), "--out", str(out), "--profile", str(PROFILE)]
    assert main(argv) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(rendered("k8s"))
    assert yaml.safe_load((out / "train-job.yaml").read_text()) == rendered("k8s")["train-job.yaml"]
    (out / "mine.txt").write_text("keep me")
    assert main(argv) == 2
    assert "is not empty" in capsys.readouterr().err and (out / "mine.txt").read_text() == "keep me"
    assert main([*argv, "--force", "--set", "trainer.world_size=4"]) == 0
    assert not (out / "mine.txt").exists()
    assert yaml.safe_load((out / "train-job.yaml").read_text())["spec"]["parallelism"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp directory left behind
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus_per_train_pod: -1\n")
    assert main(["deploy", "render", str(CASES["k8s"][0]), "--out", str(tmp_path / "o2"), "--profile",
                 str(bad)]) == 2
    assert "gpus_per_train_pod" in capsys.readouterr().err and not (tmp_path / "o2").exists()


def test_write_refuses_a_file_as_out(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_text("x")
    with pytest.raises(RenderError, match="not a directory"):
        write_manifests({}, target)


def test_deploy_files_parse_and_refer_to_files_that_exist() -> None:
    values = yaml.safe_load((ROOT / "deploy" / "values.yaml").read_text())
    deployment = values["dagster-user-deployments"]["deployments"][0]
    assert deployment["dagsterApiGrpcArgs"][:2] == ["-m", "jobs"]
    assert values["runLauncher"]["type"] == "K8sRunLauncher" and values["postgresql"]["enabled"] is True
    load_profile(PROFILE)
    for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                if not src.startswith("--"):
                    assert (ROOT / src).exists(), f"deploy/Dockerfile copies {src}, which does not exist"
