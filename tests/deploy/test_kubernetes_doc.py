"""The commands of docs/kubernetes.md (from an empty cluster to a sweep), checked without a cluster, Docker
engine or helm: the `factory` commands run (into a temp directory), and every file the `docker`, `kubectl` and
`helm` commands name exists, and is a valid spec, deploy profile or strictly valid Kubernetes object as it
should be."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from factory.cli import main
from factory.config import load_spec
from factory.deploy.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "kubernetes.md"
K8S_VERSION = "1.37.0"


def commands() -> list[list[str]]:
    block = re.search(r"```sh\n(.*?)```", PAGE.read_text(), re.S)
    assert block, f"{PAGE}: no ```sh block"
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def validate(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path}: {e.message} at {'.'.join(map(str, e.path))}")


def test_the_commands_run_or_name_files_that_exist_and_validate(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # `--out manifests/...` lands here; the page's other paths are the repository's
    cmds = commands()
    tools = [c[0] for c in cmds]
    assert {"docker", "kubectl", "helm", "factory"} <= set(tools)
    checked = 0
    for cmd in cmds:
        tool, args = cmd[0], cmd[1:]
        if tool == "factory":
            resolved = [str(ROOT / a) if (ROOT / a).is_file() else a for a in args]
            assert main(resolved) == 0, f"{shlex.join(cmd)}: {capsys.readouterr()}"
        elif tool == "docker" and args[0] == "build":
            assert (ROOT / args[args.index("-f") + 1]).is_file()
        elif tool == "kubectl" and args[:1] == ["apply"]:
            for i, a in enumerate(args):
                if a == "-f":
                    target = tmp_path / args[i + 1] if args[i + 1].startswith("manifests/") else ROOT / args[i + 1]
                    files = sorted(target.glob("*.yaml")) if target.is_dir() else [target]
                    assert files and all(f.is_file() for f in files), target
                    for f in files:
                        validate(f)
        elif tool == "kubectl" and "configmap" in args:
            for a in args:
                if a.startswith("--from-file="):
                    key, path = a.removeprefix("--from-file=").split("=", 1)
                    {"spec.yaml": load_spec, "deploy.yaml": load_profile}[key](ROOT / path)
        elif tool == "helm" and "-f" in args:
            assert (ROOT / args[args.index("-f") + 1]).is_file()
        else:
            continue
        checked += 1
    assert checked >= 8  # build, pvc, configmap, 2 renders, 2 applies, helm install


def test_the_configmap_keys_are_the_paths_values_yaml_points_the_code_location_at() -> None:
    values = yaml.safe_load((ROOT / "deploy" / "values.yaml").read_text())
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    env = {e["name"]: e["value"] for e in deployment["env"]}
    mount = next(m["mountPath"] for m in deployment["volumeMounts"] if m["name"] == "factory-deploy")
    keys = {a.removeprefix("--from-file=").split("=", 1)[0] for c in commands() for a in c
            if a.startswith("--from-file=")}
    assert env["FACTORY_PROFILE"] == "k8s"
    assert {env["FACTORY_SPEC"], env["FACTORY_DEPLOY_PROFILE"]} == {f"{mount}/{k}" for k in keys}
