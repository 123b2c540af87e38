"""Which deployment the Dagster code location is built for, chosen by one setting, `FACTORY_PROFILE`:

- `local` (the default, and what an unset variable means): everything as before — the embedded instance, steps
  in the run worker's process, training in the asset's process. Nothing below is imported or read.
- `k8s`: the same `Definitions` with the `k8s_job_executor` (each step its own pod), per-asset
  `dagster-k8s/config` op tags derived from the code location's spec (`FACTORY_SPEC`) and the deploy profile
  (`FACTORY_DEPLOY_PROFILE`, a YAML file; defaults in profile.py), and the GRPO run launched as an Indexed Job of
  trainer pods that report back through Dagster Pipes (deploy/cluster.py). The `K8sRunLauncher` and Postgres are
  instance settings, so they live in the Helm values (deploy/values.yaml), not here.

Which step pod gets what (`ASSET_ROLES`): the steps that train in their own process (SFT, the control, sweep
members) get one training pod's GPUs and node pool; `grpo_run` only launches and watches the trainer pods, so its
step pod is a CPU pod; evals, sweep summaries, datasets and data are CPU pods (the profile's `eval` role).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from factory.config import ExperimentSpec, SpecError
from factory.deploy.profile import DeployProfile, ProfileError, load_profile
from factory.envs.spec_check import load_checked_spec

if TYPE_CHECKING:
    from dagster import ExecutorDefinition

PROFILE_ENV = "FACTORY_PROFILE"
DEPLOY_PROFILE_ENV = "FACTORY_DEPLOY_PROFILE"
SPEC_ENV = "FACTORY_SPEC"
DEFAULT_SPEC = "examples/quickstart.yaml"
PROFILES = ("local", "k8s")

# Asset (op) name -> the tag set its step pod gets (keys of manifests.dagster_tags).
ASSET_ROLES = {
    "sft_checkpoint": "training", "sft_control": "training", "sweep_warm_start": "training",
    "sweep_member_run": "training", "grpo_run": "launcher",
    "checkpoint_eval": "evals", "eval_report": "evals",
    "sweep_summary": "sweeps",
    "task_dataset": "data", "blend": "data", "prompt_stats": "data",
    # a preflight of the node its step pod lands on, a training pod's (`factory deploy preflight` tests every node)
    "node_health": "training",
}


class ProfileSettingError(ValueError):
    """FACTORY_PROFILE (or a file it needs) is wrong; the message names the setting and what was expected."""


def profile_name() -> Literal["local", "k8s"]:
    value = (os.environ.get(PROFILE_ENV) or "local").strip().lower()
    if value not in PROFILES:
        raise ProfileSettingError(f"{PROFILE_ENV}: expected one of {', '.join(PROFILES)}, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class K8sTarget:
    """The cluster a `k8s` code location launches onto: the deploy profile, the spec the pod tags come from, and
    the tags per role."""

    profile: DeployProfile
    spec: ExperimentSpec
    tags: dict[str, dict[str, str]]

    def op_tags(self, role: str) -> dict[str, str]:
        return dict(self.tags[role])


@functools.cache
def k8s_target() -> K8sTarget | None:
    """The k8s target when FACTORY_PROFILE=k8s, else None. Read once per process (the code location's import)."""
    if profile_name() != "k8s":
        return None
    # the manifests pull in the rollout backends' server specs: only the k8s profile renders tags
    from factory.deploy.manifests import dagster_tags  # noqa: PLC0415 the k8s profile only (~0.1 s at every load)

    spec_path = os.environ.get(SPEC_ENV) or DEFAULT_SPEC
    try:
        profile = load_profile(os.environ.get(DEPLOY_PROFILE_ENV) or None)
        spec = load_checked_spec(spec_path)
        tags = dagster_tags(spec, profile)
    except (ProfileError, SpecError) as e:
        raise ProfileSettingError(f"{PROFILE_ENV}=k8s: {e}") from None
    except ValueError as e:  # a layout the profile cannot place, named by field
        raise ProfileSettingError(f"{PROFILE_ENV}=k8s with spec {spec_path}: {e}") from None
    return K8sTarget(profile=profile, spec=spec, tags=tags)


def op_tags(asset_name: str) -> dict[str, str]:
    """The op tags of an asset's step: `dagster-k8s/config` for its pod under FACTORY_PROFILE=k8s, else none."""
    if asset_name not in ASSET_ROLES:
        raise KeyError(f"{asset_name}: no step role in deploy/target.py ASSET_ROLES; add it there")
    return role_tags(ASSET_ROLES[asset_name])


def role_tags(role: str) -> dict[str, str]:
    """The op tags of a step pod of `role` (a key of manifests.dagster_tags) under k8s, else none."""
    target = k8s_target()
    return {} if target is None else target.op_tags(role)


def executor() -> ExecutorDefinition | None:
    """The code location's executor: the k8s_job_executor in the profile's namespace under k8s; None (Dagster's
    default, steps in the run worker) otherwise."""
    target = k8s_target()
    if target is None:
        return None
    from dagster_k8s import k8s_job_executor  # noqa: PLC0415 heavy: dagster-k8s, kubernetes; the k8s profile only

    return k8s_job_executor.configured(executor_config(target.profile), name="factory_k8s")


def executor_config(profile: DeployProfile) -> dict[str, object]:
    # max_concurrent: steps of one run holding pods at once, so a run does not queue many GPU pods
    return {"job_namespace": profile.namespace, "image_pull_policy": "IfNotPresent", "max_concurrent": 4}
