"""deploy/values.yaml against Dagster's Helm chart, without helm: merged over the chart's default values as Helm merges
them, it validates against the chart's values.schema.json (the umbrella chart's, and the dagster-user-deployments
subchart's for its section), every key in it is one the chart knows (the schema leaves most objects open, so a
misspelled key would otherwise pass), the Kubernetes objects in it are strictly valid, and what Factory depends on
holds: the K8sRunLauncher, Postgres, our image and `jobs` code location, and the ConfigMap / Secret / DAGSTER_HOME
names that factory/deploy/manifests.py passes to dagster-k8s. The chart files are copies (tests/deploy/fixtures/
dagster-chart/README.md says from where); nothing is fetched. What only `helm template` would show (the templates'
output) is not checked here."""

from __future__ import annotations

import ast
import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from factory.deploy.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
CHART = Path(__file__).parent / "fixtures" / "dagster-chart"
VALUES = ROOT / "deploy" / "values.yaml"
MANIFESTS = ROOT / "factory" / "deploy" / "manifests.py"
SUBCHART = "dagster-user-deployments"
# The chart's schema points its Kubernetes objects at this document (gone from the web since 2025). It is served
# from kubernetes-validate's copy of the definitions instead: the oldest version it ships, nearest to 1.18.
K8S_DEFS_URL = "https://kubernetesjsonschema.dev/v1.18.0/_definitions.json"
K8S_DEFS_VERSION = "v1.25.0"
# Keys the chart uses that neither its schema nor its default values declare, not looked into below them:
# global.fullnameOverride, read by helpers/_helpers.tpl's "dagster.fullname"; postgresql.persistence, passed on to
# the bitnami/postgresql 8.1.0 subchart the chart depends on (its values are not among the fixtures).
EXTRA_KEYS = {"global.fullnameOverride", "postgresql.persistence"}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@cache
def _chart_file(name: str) -> str:
    return (CHART / name).read_text()


def chart_yaml(name: str) -> Any:
    """A chart file, parsed anew each call (callers mutate it)."""
    return yaml.safe_load(_chart_file(name))


def chart_json(name: str) -> Any:
    return json.loads(_chart_file(name))


def coalesce(defaults: Any, overrides: Any) -> Any:
    """Helm's merge of user values over a chart's defaults: maps merge key by key, anything else (lists included)
    replaces the default, and a null deletes the key."""
    if not (isinstance(defaults, dict) and isinstance(overrides, dict)):
        return copy.deepcopy(overrides)
    out = copy.deepcopy(defaults)
    for key, value in overrides.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = coalesce(out.get(key), value)
    return out


def subchart_values(merged: dict) -> dict:
    """What the subchart is rendered (and validated) with: its own defaults, under the parent's section for it,
    with the parent's globals."""
    sub = coalesce(chart_yaml(f"charts/{SUBCHART}/values.yaml"), merged.get(SUBCHART) or {})
    sub["global"] = coalesce(sub.get("global") or {}, merged.get("global") or {})
    return sub


@cache
def k8s_definitions(strict: bool) -> dict:
    variant = f"{K8S_DEFS_VERSION}-local" + ("-strict" if strict else "")
    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / variant / "_definitions.json"
    doc = json.loads(path.read_text())
    doc.pop("$id")  # so its own "#/$defs/..." refs resolve within the document at the chart's URL
    doc["definitions"] = doc["$defs"]  # the chart's refs say "#/definitions/io.k8s..."
    return doc


def registry(strict: bool) -> Registry:
    # Only the Kubernetes definitions resolve; any other remote $ref fails instead of being fetched.
    return Registry().with_resource(K8S_DEFS_URL, Resource(k8s_definitions(strict), DRAFT202012))


def schema_errors(values: dict, schema: str) -> list[str]:
    # No "$schema" in the chart's schema: the newest draft, where keywords beside a $ref count, as in Helm 3.18+.
    validator = jsonschema.Draft202012Validator(chart_json(schema), registry=registry(strict=False))
    # best_match: inside an anyOf, the alternative's own error (an unexpected key, a type) rather than "not valid
    # under any of the given schemas"
    errors = [jsonschema.exceptions.best_match([e]) for e in validator.iter_errors(values)]
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def _alternatives(node: dict, root: dict):
    """A schema node with its local $refs followed and its anyOf alternatives listed."""
    ref = node.get("$ref", "")
    if ref.startswith("#/definitions/"):
        yield from _alternatives(root["definitions"][ref.removeprefix("#/definitions/")], root)
        return
    yield node
    for alternative in node.get("anyOf", []):
        yield from _alternatives(alternative, root)


def walk(ours: Any, schema: dict | None, defaults: Any, root: dict, path: str = "") -> tuple[list[str], list[tuple]]:
    """(keys of `ours` that neither the schema nor the chart's defaults have at that place, the Kubernetes objects in
    `ours` as (path, their definition's URL, value)). Objects free-form in both (e.g. postgresqlParams) are not
    looked into."""
    nodes = list(_alternatives(schema, root)) if schema else []
    k8s_refs = [n["$ref"] for n in nodes if n.get("$ref", "").startswith("https://")]
    if k8s_refs:
        return [], [(path, k8s_refs[0], ours)]
    unknown: list[str] = []
    objects: list[tuple] = []
    if isinstance(ours, dict):
        props = {key: sub for n in nodes for key, sub in n.get("properties", {}).items()}
        known = defaults if isinstance(defaults, dict) else {}
        if not props and not known:
            return [], []
        for key, value in ours.items():
            where = f"{path}.{key}" if path else key
            if key not in props and key not in known and where not in EXTRA_KEYS:
                unknown.append(where)
                continue
            u, o = walk(value, props.get(key), known.get(key), root, where)
            unknown += u
            objects += o
    elif isinstance(ours, list):
        items = next((n["items"] for n in nodes if "items" in n), None)
        example = defaults[0] if isinstance(defaults, list) and defaults else None
        for i, value in enumerate(ours):
            u, o = walk(value, items, example, root, f"{path}[{i}]")
            unknown += u
            objects += o
    return unknown, objects


def k8s_errors(objects: list[tuple]) -> list[str]:
    """Each Kubernetes object against Kubernetes' strict definition (unknown fields refused)."""
    out = []
    for path, url, value in objects:
        validator = jsonschema.Draft202012Validator({"$ref": url}, registry=registry(strict=True))
        out += [f"{path}: {jsonschema.exceptions.best_match([e]).message}" for e in validator.iter_errors(value)]
    return out


def problems(values: dict) -> list[str]:
    """Everything wrong with `values` as values for the chart; empty when they pass."""
    merged = coalesce(chart_yaml("values.yaml"), values)
    found = schema_errors(merged, "values.schema.json")
    found += [f"{SUBCHART}: {e}" for e in
              schema_errors(subchart_values(merged), f"charts/{SUBCHART}/values.schema.json")]
    root = chart_json("values.schema.json")
    unknown, objects = walk(values, root, chart_yaml("values.yaml"), root)
    return found + [f"{key}: not a key of the chart" for key in unknown] + k8s_errors(objects)


def ours() -> dict:
    return load_yaml(VALUES)


def merged() -> dict:
    return coalesce(chart_yaml("values.yaml"), ours())


def test_chart_defaults_validate_against_the_chart_schemas() -> None:
    # The fixtures come from different commits (README there): they must at least agree with each other.
    defaults = chart_yaml("values.yaml")
    assert schema_errors(defaults, "values.schema.json") == []
    assert schema_errors(subchart_values(defaults), f"charts/{SUBCHART}/values.schema.json") == []


def test_our_values_pass_every_check() -> None:
    assert problems(ours()) == []
    # the walk did reach the Kubernetes objects (so k8s_errors checked something)
    _, objects = walk(ours(), chart_json("values.schema.json"), chart_yaml("values.yaml"),
                      chart_json("values.schema.json"))
    assert {path for path, _, _ in objects} >= {"runLauncher.config.k8sRunLauncher.volumes[0]",
                                                f"{SUBCHART}.deployments[0].volumes[0]",
                                                f"{SUBCHART}.deployments[0].resources"}


def _set(values: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = values
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value


def _rename(values: dict, dotted: str, new: str) -> None:
    *parents, last = dotted.split(".")
    node = values
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[new] = node.pop(last)


@pytest.mark.parametrize(("mutate", "expected"), [
    # a misspelled key where the schema closes the object
    (lambda v: _rename(v, "runLauncher.config.k8sRunLauncher.envVars", "envVar"), "'envVar' was unexpected"),
    # a misspelled key where the schema leaves the object open: only the known-keys walk sees it
    (lambda v: _rename(v, f"{SUBCHART}.deployments.0.dagsterApiGrpcArgs", "dagsterApiGrpcArg"),
     "dagsterApiGrpcArg: not a key of the chart"),
    (lambda v: _rename(v, "postgresql.postgresqlUsername", "postgresqlUser"), "postgresqlUser: not a key"),
    # a misspelled field inside a Kubernetes object
    (lambda v: _rename(v, "runLauncher.config.k8sRunLauncher.volumes.0.persistentVolumeClaim", "pvc"),
     "'pvc' was unexpected"),
    # wrong types and enum values
    (lambda v: _set(v, f"{SUBCHART}.deployments.0.port", "3030"), "'3030' is not of type 'integer'"),
    (lambda v: _set(v, "runLauncher.type", "K8sRunlauncher"), "K8sRunlauncher"),
    (lambda v: _set(v, "dagsterDaemon.runCoordinator.config.queuedRunCoordinator.maxConcurrentRuns", "4"),
     "maxConcurrentRuns: '4' is not valid"),
    (lambda v: _set(v, f"{SUBCHART}.deployments.0.resources.requests.cpu", []), "requests.cpu: [] is not valid"),
])
def test_a_mutated_values_file_fails(mutate, expected: str) -> None:
    values = ours()
    mutate(values)
    found = problems(values)
    assert any(expected in p for p in found), found


def test_a_misspelled_key_in_the_file_text_fails() -> None:
    text = VALUES.read_text()
    assert text.count("    type: QueuedRunCoordinator") == 1
    mutated = yaml.safe_load(text.replace("    type: QueuedRunCoordinator", "    typ: QueuedRunCoordinator"))
    expected = "dagsterDaemon.runCoordinator: Additional properties are not allowed ('typ' was unexpected)"
    assert expected in problems(mutated)


def test_runs_launch_as_kubernetes_jobs_with_factory_home_on_the_checkpoint_volume() -> None:
    values, profile = merged(), load_profile(ROOT / "deploy" / "profile.example.yaml")
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    assert "FACTORY_HOME=/data/factory" in launcher["envVars"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in launcher["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in launcher["volumeMounts"]}
    assert claims == {"data": profile.checkpoint_pvc} and mounts == {"data": "/data"}  # manifests.DATA_MOUNT
    # the daemon launches runs (queued) and is on
    assert values["dagsterDaemon"]["enabled"] and values["dagsterDaemon"]["runCoordinator"]["enabled"]


def test_a_dead_run_worker_is_noticed_and_its_run_retried() -> None:
    # The chart writes these into the instance's dagster.yaml (its configmap-instance.yaml): run monitoring marks a
    # run whose worker pod died as failed, run retries re-execute the jobs that ask (assets/_retries.py).
    daemon = merged()["dagsterDaemon"]
    assert daemon["enabled"]
    assert daemon["runMonitoring"]["enabled"] and daemon["runMonitoring"]["maxResumeRunAttempts"] == 0
    assert daemon["runRetries"]["enabled"] and daemon["runRetries"]["maxRetries"] == 0
    assert ours()["dagsterDaemon"]["runRetries"]["enabled"]  # said here, not left to the chart's defaults


def test_postgres_is_deployed_or_an_external_one_is_named() -> None:
    pg = merged()["postgresql"]
    assert pg["enabled"] is True or pg["postgresqlHost"], "the instance's storage needs a Postgres"
    assert pg["postgresqlUsername"] and pg["postgresqlDatabase"]


def test_the_code_location_runs_our_image_with_the_workspace_module() -> None:
    values, profile = merged(), load_profile(ROOT / "deploy" / "profile.example.yaml")
    section = values[SUBCHART]
    assert section["enabled"] and section["enableSubchart"]
    [deployment] = section["deployments"]
    image = deployment["image"]
    # the run and step pods `factory deploy render` writes run the profile's image: the code location must be it
    assert f"{image['repository']}:{image['tag']}" == profile.image
    [location] = load_yaml(ROOT / "workspace.yaml")["load_from"]
    module = location["python_module"]["module_name"]
    assert deployment["dagsterApiGrpcArgs"] == ["-m", module]
    assert (ROOT / module / "__init__.py").exists()
    attribute = location["python_module"]["attribute"]
    assert re.search(rf"^{attribute} = ", (ROOT / module / "__init__.py").read_text(), re.M)
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"EXPOSE {deployment['port']}" in dockerfile
    env = {e["name"]: e["value"] for e in deployment["env"]}
    assert env["FACTORY_HOME"] == "/data/factory"


def manifests_job_config() -> dict[str, Any]:
    """The keyword arguments factory/deploy/manifests.py passes to dagster-k8s's DagsterK8sJobConfig (read from its
    source: the run worker Job dagster-k8s builds does not show the instance ConfigMap)."""
    for node in ast.walk(ast.parse(MANIFESTS.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DagsterK8sJobConfig":
            return {k.arg: ast.literal_eval(k.value) for k in node.keywords
                    if k.arg in ("instance_config_map", "postgres_password_secret", "dagster_home")}
    raise AssertionError("no DagsterK8sJobConfig(...) call in factory/deploy/manifests.py")


def chart_fullname(values: dict, release: str) -> str:
    """The chart's "dagster.fullname" (templates/helpers/_helpers.tpl)."""
    g = values["global"]
    if g.get("fullnameOverride"):
        return g["fullnameOverride"][:63].removesuffix("-")
    name = g.get("nameOverride") or "dagster"
    return (release if name in release else f"{release}-{name}")[:63].removesuffix("-")


@pytest.mark.parametrize("release", ["dagster", "factory"])
def test_instance_configmap_secret_and_home_are_the_ones_manifests_use(release: str) -> None:
    values, job = merged(), manifests_job_config()
    assert set(job) == {"instance_config_map", "postgres_password_secret", "dagster_home"}
    # the chart's instance ConfigMap (templates/configmap-instance.yaml) is "<fullname>-instance"
    assert f"{chart_fullname(values, release)}-instance" == job["instance_config_map"]
    # its Postgres password Secret ("dagster.postgresql.secretName"), created by the chart when it generates one
    secret = values["global"]["postgresqlSecretName"] or f"{chart_fullname(values, release)}-postgresql-secret"
    assert secret == job["postgres_password_secret"] and values["generatePostgresqlPasswordSecret"] is True
    assert values["global"]["dagsterHome"] == job["dagster_home"]
    assert f"DAGSTER_HOME={job['dagster_home']}" in (ROOT / "deploy" / "Dockerfile").read_text()


def test_without_the_override_a_release_not_named_dagster_would_break_the_configmap_name() -> None:
    values = merged()
    del values["global"]["fullnameOverride"]
    assert chart_fullname(values, "dagster") == "dagster"
    assert chart_fullname(values, "factory") + "-instance" != manifests_job_config()["instance_config_map"]
