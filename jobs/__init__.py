"""Dagster jobs and the `Definitions` object that `workspace.yaml` loads."""

from __future__ import annotations

from dagster import AssetSelection, Definitions, define_asset_job

from assets.datasets import arithmetic_dataset
from assets.evals import checkpoint_eval, eval_report
from assets.preflight import node_health
from assets.sweeps import sweep_member_run, sweep_summary, sweep_warm_start
from assets.training import grpo_beats_sft, grpo_run, sft_checkpoint, sft_control
from jobs.evals import checkpoint_eval_job, eval_schedule, new_checkpoint_evals
from jobs.preflight import preflight_job, preflight_schedule
from jobs.sweeps import (
    sweep,
    sweep_launcher,
    sweep_member_job,
    sweep_summarizer,
    sweep_summary_job,
    sweep_warm_start_job,
)
from resources import FactoryHomeResource, LakeResource, MlflowResource, SpecResource

QUICKSTART_ASSETS = [arithmetic_dataset, sft_checkpoint, grpo_run, sft_control, eval_report]
ALL_ASSETS = [*QUICKSTART_ASSETS, sweep_warm_start, sweep_member_run, sweep_summary, checkpoint_eval, node_health]
ALL_CHECKS = [grpo_beats_sft]

quickstart = define_asset_job(
    "quickstart",
    selection=AssetSelection.assets(*QUICKSTART_ASSETS),
    description="Dataset → SFT warm start → GRPO → control → eval report, on the embedded defaults.",
)


def make_resources(spec_path: str = "examples/quickstart.yaml", overrides: list[str] | None = None,
                   home: str = "") -> dict:
    home_res = FactoryHomeResource(root=home)
    return {
        "spec": SpecResource(path=spec_path, overrides=overrides or []),
        "home": home_res,
        "lake": LakeResource(home=home_res),
        "mlflow": MlflowResource(home=home_res),
    }


defs = Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[quickstart, sweep, sweep_warm_start_job, sweep_member_job, sweep_summary_job, checkpoint_eval_job,
          preflight_job],
    sensors=[sweep_launcher, sweep_summarizer, new_checkpoint_evals],
    schedules=[eval_schedule, preflight_schedule],
    resources=make_resources(),
)
