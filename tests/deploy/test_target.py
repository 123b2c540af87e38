"""FACTORY_PROFILE=k8s: the same Definitions, with the k8s_job_executor and per-asset `dagster-k8s/config` op tags
derived from the code location's spec and the deploy profile; what dagster-k8s builds from those tags (its own
step-Job construction) is strictly valid Kubernetes. The local default is untouched. No API server: the code
location is loaded and the step Jobs are built, never launched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest

from factory.deploy import target
from factory.deploy.manifests import DAGSTER_CONFIG_TAG
from factory.deploy.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "deploy" / "profile.example.yaml"
K8S_SPEC = ROOT / "examples" / "k8s.yaml"
GPU = "nvidia.com/gpu"

# Loads the code location as `dagster` would (workspace.yaml: module `jobs`, attribute `defs`) and prints what
# the k8s_job_executor would use: its config and every asset step's tags.
PROBE = """
import json
import jobs
defs = jobs.defs
ex = defs.executor
out = {"executor": None if ex is None else ex.name, "tags": {}, "launcher": None}
for key in defs.resolve_asset_graph().get_all_asset_keys():
    ad = defs.resolve_assets_def(key)
    if ad.is_executable and ad.node_def is not None:
        out["tags"][key.to_user_string()] = dict(ad.node_def.tags)
out["launcher"] = jobs.RESOURCES["launcher"].where
print(json.dumps(out, default=str))
"""


def load_code_location(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in (target.PROFILE_ENV, target.DEPLOY_PROFILE_ENV,
                                                             target.SPEC_ENV)}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**clean, **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def k8s_location() -> dict:
    return load_code_location(FACTORY_PROFILE="k8s", FACTORY_DEPLOY_PROFILE=str(PROFILE), FACTORY_SPEC=str(K8S_SPEC))


@pytest.mark.slow
def test_the_local_default_has_no_executor_and_no_pod_tags() -> None:
    loc = load_code_location()
    assert loc["executor"] is None and loc["launcher"] == "in_process"
    assert all(DAGSTER_CONFIG_TAG not in tags for tags in loc["tags"].values())


@pytest.mark.slow
def test_k8s_profile_uses_the_k8s_job_executor_and_launches_training_on_the_cluster(k8s_location: dict) -> None:
    assert k8s_location["executor"] == "factory_k8s" and k8s_location["launcher"] == "k8s"
    from dagster_k8s import k8s_job_executor

    config = target.executor_config(load_profile(PROFILE))
    assert config["job_namespace"] == "factory"
    from dagster._config import process_config

    assert process_config(k8s_job_executor.config_schema.config_type, config).success  # the executor's own schema
    assert not process_config(k8s_job_executor.config_schema.config_type, {**config, "namespace": "x"}).success


def test_every_asset_step_gets_its_pod_from_the_spec_and_profile(k8s_location: dict) -> None:
    tags = {name: json.loads(t[DAGSTER_CONFIG_TAG]) for name, t in k8s_location["tags"].items()
            if DAGSTER_CONFIG_TAG in t}
    assert set(tags) == set(k8s_location["tags"])  # no step pod left to dagster's defaults, prompt sources included
    assert set(target.ASSET_ROLES) <= set(tags)
    limits = {name: cfg["container_config"]["resources"]["limits"] for name, cfg in tags.items()}
    # examples/k8s.yaml trains 8 ranks; the profile puts 4 GPUs in a training pod
    for name in ("sft_checkpoint", "sft_control", "sweep_member_run", "sweep_warm_start"):
        assert limits[name][GPU] == "4", name
        assert tags[name]["pod_spec_config"]["nodeSelector"] == {"cloud.example.com/pool": "gpu-h100"}
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in tags[name]["pod_spec_config"][
            "tolerations"]
    # grpo_run only launches the trainer pods: a CPU pod, as evals, sweep summaries and data
    for name in ("grpo_run", "eval_report", "checkpoint_eval", "sweep_summary", "blend", "task_dataset"):
        assert GPU not in limits[name], name
        assert tags[name]["pod_spec_config"]["nodeSelector"] == {"cloud.example.com/pool": "cpu"}, name
    for cfg in tags.values():  # every pod reads the team's services from the env Secret, optional
        assert cfg["container_config"]["envFrom"] == [{"secretRef": {"name": "factory-env", "optional": True}}]


@pytest.mark.slow
def test_dagster_k8s_builds_valid_step_jobs_from_the_asset_tags(k8s_location: dict) -> None:
    from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config
    from kubernetes.client import ApiClient

    config = DagsterK8sJobConfig(job_image="registry.example.com/factory:0.1.0", dagster_home="/opt/dagster/home",
                                 instance_config_map="dagster-instance")
    for name, tags in sorted(k8s_location["tags"].items()):
        job = construct_dagster_k8s_job(config, ["dagster", "api", "execute_step", "..."], f"dagster-step-{name[:30]}"
                                        .replace("_", "-"), get_user_defined_k8s_config(tags), component="step_worker")
        manifest = ApiClient().sanitize_for_serialization(job)
        try:
            kubernetes_validate.validate(manifest, "1.37.0", strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {e.message} at {'.'.join(map(str, e.path))}")
        pod = manifest["spec"]["template"]["spec"]
        assert {"secretRef": {"name": "factory-env", "optional": True}} in pod["containers"][0]["envFrom"]


def test_a_bad_profile_setting_is_named(monkeypatch) -> None:
    monkeypatch.setenv(target.PROFILE_ENV, "kube")
    with pytest.raises(target.ProfileSettingError, match="FACTORY_PROFILE: expected one of local, k8s, got 'kube'"):
        target.profile_name()
    monkeypatch.setenv(target.PROFILE_ENV, "k8s")
    monkeypatch.setenv(target.DEPLOY_PROFILE_ENV, "/nonexistent/deploy.yaml")
    target.k8s_target.cache_clear()
    try:
        with pytest.raises(target.ProfileSettingError, match="no such deploy profile: /nonexistent/deploy.yaml"):
            target.k8s_target()
    finally:
        target.k8s_target.cache_clear()
