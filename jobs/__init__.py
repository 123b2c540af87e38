"""Dagster jobs and the `Definitions` object that `workspace.yaml` loads."""

from __future__ import annotations

import os

from dagster import AssetSelection, Definitions, define_asset_job

from assets._retries import TRAINING_TAGS
from assets.data import data_assets, prompt_stats
from assets.datasets import task_dataset
from assets.evals import checkpoint_eval, eval_report
from assets.preflight import node_health
from assets.sweeps import sweep_member_run, sweep_summary, sweep_warm_start
from assets.training import grpo_beats_sft, grpo_run, sft_checkpoint, sft_control
from factory.deploy.target import executor, profile_name
from jobs.data import blend_job, prompt_stats_sensor
from jobs.evals import checkpoint_eval_job, eval_schedule, new_checkpoint_evals
from jobs.preflight import preflight_job, preflight_schedule
from jobs.sweep_live import sweep_live
from jobs.sweeps import (
    sweep,
    sweep_control,
    sweep_launcher,
    sweep_member_job,
    sweep_summarizer,
    sweep_summary_job,
    sweep_warm_start_job,
)
from resources import FactoryHomeResource, LakeResource, MlflowResource, SpecResource, TrainingLauncherResource
from resources.lineage import LineageIOManager

# The spec the code location is built from: its prompt sources are assets (assets/data.py). FACTORY_SPEC
# (a YAML path) loads another spec; the blend refuses to run with a spec whose sources differ from these.
SPEC_PATH = os.environ.get("FACTORY_SPEC") or "examples/quickstart.yaml"


def make_resources(spec_path: str = "examples/quickstart.yaml", overrides: list[str] | None = None,
                   home: str = "") -> dict:
    home_res = FactoryHomeResource(root=home)
    return {
        "spec": SpecResource(path=spec_path, overrides=overrides or []),
        "home": home_res,
        "lake": LakeResource(home=home_res),
        "mlflow": MlflowResource(home=home_res),
        # FACTORY_PROFILE=k8s: the GRPO run's trainer pods on the cluster; else in the asset's process
        "launcher": TrainingLauncherResource(where="k8s" if profile_name() == "k8s" else "in_process"),
        # the dataset, SFT checkpoint and GRPO run reach their downstream assets as this run's own materializations
        "lineage": LineageIOManager(),
    }


RESOURCES = make_resources(SPEC_PATH)
DATA_ASSETS = data_assets(RESOURCES["spec"].spec())  # source_<name> per prompt source, and the blend
# The first three stay dataset, SFT, GRPO (tests materialize QUICKSTART_ASSETS[:3]); the data assets come after,
# in graph order whatever the list order.
QUICKSTART_ASSETS = [task_dataset, sft_checkpoint, grpo_run, sft_control, eval_report, *DATA_ASSETS,
                     prompt_stats]
ALL_ASSETS = [*QUICKSTART_ASSETS, sweep_warm_start, sweep_member_run, sweep_summary, checkpoint_eval, node_health]
ALL_CHECKS = [grpo_beats_sft]

quickstart = define_asset_job(
    "quickstart",
    selection=AssetSelection.assets(*QUICKSTART_ASSETS),
    tags=TRAINING_TAGS,  # a run worker that died is re-executed from the failed step (deploy/dagster.yaml)
    description="Prompt sources → blend, dataset → SFT warm start → GRPO → control → eval report and prompt stats, "
                "on the embedded defaults.",
)

defs = Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[quickstart, blend_job(DATA_ASSETS), sweep, sweep_control, sweep_warm_start_job, sweep_member_job,
          sweep_summary_job, checkpoint_eval_job, preflight_job],
    sensors=[sweep_launcher, sweep_summarizer, sweep_live, new_checkpoint_evals, prompt_stats_sensor],
    schedules=[eval_schedule, preflight_schedule],
    resources=RESOURCES,
    executor=executor(),  # FACTORY_PROFILE=k8s: the k8s_job_executor (a pod per step); else Dagster's default
)
