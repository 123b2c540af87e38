"""`render(spec, profile)`: every manifest Factory would create for a spec, by file name; `write_manifests`
writes them as YAML into a directory atomically (a temp directory beside it, then renamed into place).

The output is for review and GitOps; it has not been applied to a real cluster (docs/kubernetes.md).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import yaml

from factory.config import ExperimentSpec
from factory.deploy import manifests as m
from factory.deploy.profile import DeployProfile


class RenderError(ValueError):
    """The manifests could not be rendered or written; the message says which field or path."""


def render(spec: ExperimentSpec, profile: DeployProfile) -> dict[str, m.Manifest]:
    """{file name: manifest} for the spec under the profile, in apply order (ConfigMaps and Services first)."""
    try:
        train_service, train_job = m.training(spec, profile)
        servers = m.rollout(spec, profile)
    except ValueError as e:  # a spec the cluster layout cannot run; the message names the field
        raise RenderError(str(e)) from None
    out: dict[str, m.Manifest] = {"spec-configmap.yaml": m.spec_configmap(spec, profile)}
    out["launcher-role.yaml"], out["launcher-rolebinding.yaml"] = m.launcher_rbac(spec, profile)
    tags = m.dagster_tags(spec, profile)
    out["dagster-tags-configmap.yaml"] = m.tags_configmap(spec, tags, profile)
    for obj in m.sandbox(spec, profile):
        out[f"sandbox-{obj['kind'].lower()}.yaml"] = obj
    for obj in servers:
        server = obj["metadata"]["labels"]["factory/server"]
        out[f"rollout-{server}-{obj['kind'].lower()}.yaml"] = obj
    out["train-service.yaml"] = train_service
    out["train-job.yaml"] = train_job
    for group, group_tags in tags.items():
        kind = "run" if group == m.RUN else f"step-{group}"
        out[f"dagster-{kind}-job.yaml"] = m.dagster_job(spec, profile, group, group_tags)
    return out


class _NoAliases(yaml.SafeDumper):
    """Writes a dict shared by two places (a selector and its pod labels) twice, not as a YAML anchor."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def to_yaml(manifest: m.Manifest) -> str:
    return yaml.dump(manifest, Dumper=_NoAliases, sort_keys=False, default_flow_style=False, width=120)


def to_text(manifests: dict[str, m.Manifest]) -> str:
    """All manifests as one multi-document YAML stream, each headed by its file name (what the snapshots hold)."""
    return "".join(f"---\n# {name}\n{to_yaml(obj)}" for name, obj in manifests.items())


def write_manifests(manifests: dict[str, m.Manifest], out: str | Path, force: bool = False) -> list[Path]:
    """Write each manifest as `out/<name>`; refuse a non-empty `out` unless `force` (then it is replaced whole).
    Written into a temp directory beside `out` and renamed, so `out` never holds half a render."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RenderError(f"--out: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise RenderError(f"--out: {out} is not empty (give --force to replace its contents)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, manifest in manifests.items():
            (tmp / name).write_text(to_yaml(manifest))
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            out.rename(old / "x")
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / name for name in manifests]
