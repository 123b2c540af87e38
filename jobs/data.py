"""Data jobs: refreshing the blend (observe the external sources, materialize the generated ones and the blend),
and the automation sensor that recomputes `prompt_stats` when a training run lands.

The sensor is an `AutomationConditionSensorDefinition` over `prompt_stats` alone (its condition is eager),
running by default like the other sensors here: Dagster's default automation sensor would start stopped.
"""

from dagster import AssetSelection, AutomationConditionSensorDefinition, DefaultSensorStatus, define_asset_job

from assets.data import prompt_stats


def blend_job(data_assets: list) -> object:
    """Observe the external sources, materialize the generated ones, then the blend (one run)."""
    return define_asset_job("blend_job", selection=AssetSelection.assets(*data_assets),
                            description="Observe the prompt sources and rebuild the blend: a changed source file "
                                        "or weight is a new blend version.")


prompt_stats_sensor = AutomationConditionSensorDefinition(
    "prompt_stats_on_new_runs", target=AssetSelection.assets(prompt_stats), default_status=DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30, description="Recomputes prompt_stats after a grpo_run materialization.")
