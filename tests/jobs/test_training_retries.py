"""Dagster retries of training assets resume the run: a crash in the middle of `grpo_run` is retried by its
RetryPolicy, and the retry continues the same factory run (same run_id and MLflow run, one `steps` row per step);
what retrying cannot fix is not retried."""

from __future__ import annotations

from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize

from factory.home import factory_home
from factory.lake import Lake
from jobs import QUICKSTART_ASSETS, make_resources
from tests.jobs.test_training_launch import GRPO_METADATA

SPEC = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
TINY = ["name=retry", "model.preset=micro", "task.n_train=300", "task.n_eval=24", "sft.steps=10",
        "sft.stop_at_accuracy=null", "rollout.prompts_per_step=4", "algorithm.group_size=2", "schedule.steps=6",
        "schedule.eval_pass_k=2", "ops.resume_every=2"]
TRAINING = QUICKSTART_ASSETS[:3]  # dataset, SFT, GRPO


def lake_of(home: Path) -> Lake:
    return Lake.open(factory_home(home))


@pytest.mark.slow
def test_a_crash_in_grpo_run_is_retried_and_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FACTORY_FAULT_RAISE", "publish:5")  # the 5th weight publish of this process raises
    with DagsterInstance.ephemeral() as instance:
        result = materialize(TRAINING, resources=make_resources(SPEC, TINY, str(tmp_path)), instance=instance)
        assert result.success
        retried = [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
        assert len(retried) == 1
    md = result.asset_materializations_for_node("grpo_run")[0].metadata
    assert list(md) == GRPO_METADATA  # what a Pipes launch shows too (tests/jobs/test_training_launch.py)
    lake = lake_of(tmp_path)
    (run,) = lake.read("runs").to_pylist()
    assert run["run_id"] == md["run_id"].value == f"retry-{result.run_id[:8]}"
    assert md["attempts"].value == 2 and 0 < md["goodput"].value < 1
    assert (run["status"], run["attempts"], run["restarts"]) == ("succeeded", 2, 1)
    steps = lake.read("steps").to_pylist()
    assert sorted(r["step"] for r in steps) == [1, 2, 3, 4, 5, 6]
    (cut,) = lake.read("interruptions").to_pylist()
    assert cut["cause"] == "crash" and "fault injected at publish" in cut["detail"]
    assert cut["resumed_from_step"] in (2, 4)
    # The run's page tells the crash in words (assets/_interruptions.py), not only with the first try's stack trace.
    (obs,) = [e.event_specific_data.asset_observation for e in result.all_events
              if e.event_type_value == "ASSET_OBSERVATION"
              and "cause" in e.event_specific_data.asset_observation.metadata]
    told = {k: v.value for k, v in obs.metadata.items()}
    assert (told["cause"], told["resumed_from_step"]) == ("crash", cut["resumed_from_step"])
    assert told["interrupted"].startswith(f"attempt 1 crashed at step {cut['last_step']}; resumed from step")


@pytest.mark.slow
def test_non_finite_losses_are_not_retried(tmp_path):
    spec = [*TINY, "task.environment=tests.ops.faulty_envs:overflowing_reward", "ops.max_nonfinite_steps=2"]
    with DagsterInstance.ephemeral() as instance:
        result = materialize(TRAINING, resources=make_resources(SPEC, spec, str(tmp_path)), instance=instance,
                             raise_on_error=False)
        assert not result.success
        assert not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
        failure = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"][0]
        assert "NonFiniteLoss" in str(failure.event_specific_data.error)
