"""The deploy profile: where and how a spec's pods run on a cluster (image, namespace, node pools per role,
GPU resource name, shared memory, checkpoint storage), read from a YAML file (`deploy.yaml`) or defaults.

The experiment spec says what to train and how many ranks/servers; the profile says which nodes they land on.
Errors name the field (`train.tolerations.0.effect: ...`) and the file. Not checked against a cluster: a
node selector naming no node or a PVC that does not exist is only found when the pods stay Pending.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# A Kubernetes resource quantity ("500m", "16Gi", "2"): checked here so a typo is named before any rendering.
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class ProfileError(ValueError):
    """A deploy profile that cannot be used; `str()` lists one `field: problem` line per error."""

    def __init__(self, errors: list[str], source: str | None = None):
        self.errors = errors
        head = f"invalid deploy profile {source}" if source else "invalid deploy profile"
        super().__init__(head + ":\n" + "\n".join(f"  {e}" for e in errors))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _quantity(v: str) -> str:
    if not _QUANTITY.match(v):
        raise ValueError(f"expected a Kubernetes quantity such as 500m, 4, 16Gi, got {v!r}")
    return v


class Toleration(_Strict):
    """A pod toleration (the Kubernetes field names, in camelCase as in a manifest)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None

    def manifest(self) -> dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class RoleProfile(_Strict):
    """The pods of one role: node pool (selector, tolerations) and CPU/memory per pod (requests = limits)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    cpu: str = "4"
    memory: str = "16Gi"

    _cpu = field_validator("cpu", "memory")(classmethod(lambda cls, v: _quantity(v)))


_GPU_TAINT = [Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")]


class DeployProfile(_Strict):
    """How a spec's pods are placed. Roles: train (trainer ranks), rollout (SGLang servers), eval (evals, sweeps
    summaries, data: CPU only), sandbox (the sandbox pool running generated code)."""

    image: str = Field("factory:latest", min_length=1, description="the code location image (deploy/Dockerfile)")
    rollout_image: str | None = Field(
        None, min_length=1, description="image with sglang for the rollout servers; unset: `image`")
    namespace: str = "factory"
    gpu_resource: str = Field("nvidia.com/gpu", min_length=1, description="the extended resource GPUs are under")
    gpus_per_train_pod: int = Field(8, ge=0, le=64, description="trainer ranks (one GPU each) per training pod; "
                                    "0: CPU training (one pod, no GPU)")
    shm_size: str = Field("16Gi", description="/dev/shm of training and rollout pods (NCCL, dataloaders)")
    checkpoint_pvc: str | None = Field("factory-checkpoints", description="PVC mounted at /data (FACTORY_HOME: "
                                       "lake, checkpoints) in every pod of the run, so ReadWriteMany when they "
                                       "span nodes; unset: an emptyDir, lost with the pod")
    model_path: str = Field("/data/models/policy", min_length=1, description="the model directory the rollout "
                            "servers load at start (the trainer then pushes its weights)")
    env_secret: str | None = Field("factory-env", description="a Secret whose keys become the environment of "
                                   "every Factory pod (FACTORY_CATALOG_URI, FACTORY_MLFLOW_URI, object-store "
                                   "credentials); optional: pods start without it; unset: none")
    launcher_service_account: str = Field("dagster", min_length=1, description="the service account of Dagster's "
                                          "run and step pods (deploy/values.yaml: the chart's, named `dagster`); "
                                          "grpo_run's step creates the run's objects with it")
    master_port: int = Field(29500, ge=1024, le=65535)
    sandbox_port: int = Field(8200, ge=1024, le=65535)
    train: RoleProfile = Field(default_factory=lambda: RoleProfile(tolerations=_GPU_TAINT, cpu="32", memory="256Gi"))
    rollout: RoleProfile = Field(default_factory=lambda: RoleProfile(tolerations=_GPU_TAINT, cpu="8",
                                                                     memory="64Gi"))
    eval: RoleProfile = Field(default_factory=RoleProfile)
    sandbox: RoleProfile = Field(default_factory=lambda: RoleProfile(cpu="2", memory="4Gi"))

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v: str) -> str:
        return _quantity(v)

    @field_validator("namespace", "checkpoint_pvc", "env_secret")
    @classmethod
    def _dns(cls, v: str | None) -> str | None:
        if v is not None and not _DNS_LABEL.match(v):
            raise ValueError(f"expected a DNS label (lowercase letters, digits, '-', at most 63), got {v!r}")
        return v


def _describe(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "<profile>"
    if err["type"] == "extra_forbidden":
        return f"{loc}: unknown key (not a field of the deploy profile)"
    if err["type"] == "value_error":  # our validators: the message says what was expected
        return f"{loc}: {err.get('ctx', {}).get('error', err['msg'])}"
    return f"{loc}: {err['msg']}, got {err.get('input')!r}"


def parse_profile(data: Any, source: str | None = None) -> DeployProfile:
    """Validate a mapping as a DeployProfile; raise ProfileError naming every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ProfileError([f"<profile>: expected a mapping, got {type(data).__name__}"], source)
    try:
        return DeployProfile.model_validate(data)
    except ValidationError as e:
        raise ProfileError([_describe(err) for err in e.errors(include_url=False)], source) from None


def load_profile(path: str | Path | None) -> DeployProfile:
    """The profile in `path` (YAML), or the defaults when `path` is None."""
    if path is None:
        return DeployProfile()
    path = Path(path)
    if not path.is_file():
        raise ProfileError([f"<file>: no such deploy profile: {path}"], str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ProfileError([f"<file>: not valid YAML: {e}"], str(path)) from None
    return parse_profile(data, str(path))
