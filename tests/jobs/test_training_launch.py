"""The `grpo_run` asset through Dagster Pipes: `factory train-grpo` started as a child process (the protocol the
trainer pods on Kubernetes speak, with the context in the environment; here as 2 torchrun ranks) reports the same
materialization as the run trained in the asset's own process, and its exit codes decide retries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize

from factory.home import factory_home
from factory.lake import Lake
from factory.runs.recovery import run_row
from jobs import QUICKSTART_ASSETS, make_resources
from resources import TrainingLauncherResource

SPEC = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
TINY = ["name=pipes", "model.preset=micro", "task.n_train=300", "task.n_eval=24", "sft.steps=10",
        "sft.stop_at_accuracy=null", "rollout.prompts_per_step=4", "algorithm.group_size=2", "schedule.steps=4",
        "schedule.eval_pass_k=2"]
TRAINING = QUICKSTART_ASSETS[:3]  # dataset, SFT, GRPO
GRPO_METADATA = ["curves", "evals", "metrics", "run_id", "mlflow_run_id", "checkpoint", "sha256", "steps",
                 "benchmark", "start_accuracy", "start_pass_at_k", "accuracy", "seconds", "attempts", "goodput",
                 "pictures"]


def _train(home: Path, where: str, overrides: list[str] = TINY, logs: list[str] | None = None, **kw):
    resources = {**make_resources(SPEC, overrides, str(home)), "launcher": TrainingLauncherResource(where=where)}
    with DagsterInstance.ephemeral() as instance:
        result = materialize(TRAINING, resources=resources, instance=instance, **kw)
        if logs is not None:
            logs += [e.user_message for e in instance.all_logs(result.run_id) if e.step_key == "grpo_run"]
        return result


@pytest.mark.slow
def test_a_pipes_launch_of_two_ranks_reports_what_the_in_process_run_reports(tmp_path, capfd):
    # trainer.world_size 2: train-grpo re-runs itself as 2 torchrun ranks (as in a trainer pod); rank 0 leads and
    # alone speaks Pipes. The in-process asset's metadata is GRPO_METADATA too (tests/jobs/test_training_retries.py).
    logs: list[str] = []
    piped = _train(tmp_path, "subprocess", [*TINY, "trainer.world_size=2"], logs=logs)
    assert piped.success
    # the run's progress reached the Dagster run's log through Pipes while it trained (the last step always)
    assert any("progress: progress grpo 4/4" in m for m in logs), [m for m in logs if "progress" in m]
    b = piped.asset_materializations_for_node("grpo_run")[0]
    assert list(b.metadata) == GRPO_METADATA  # the same keys in the same order as in the asset's process
    kinds = {k: type(v).__name__ for k, v in b.metadata.items()}
    assert (kinds["curves"], kinds["checkpoint"], kinds["mlflow_run_id"], kinds["steps"], kinds["accuracy"]) == (
        "MarkdownMetadataValue", "PathMetadataValue", "UrlMetadataValue", "IntMetadataValue", "FloatMetadataValue")
    assert b.metadata["run_id"].value == f"pipes-{piped.run_id[:8]}"  # the run id the launcher sent as an extra
    assert b.metadata["steps"].value == 4
    assert str(tmp_path) in b.metadata["checkpoint"].value and Path(b.metadata["checkpoint"].value).is_dir()
    assert b.tags["dagster/data_version"] == b.metadata["sha256"].value
    assert 0.0 <= b.metadata["accuracy"].value <= 1.0
    assert "data:image/png;base64," in b.metadata["pictures"].value  # drawn from the lake and MLflow here
    assert "trainer: rank 0 of 2 (fsdp on gloo)" in capfd.readouterr().out  # rank 0 of the child's torchrun


@pytest.mark.slow
def test_a_run_that_needs_a_fix_is_not_retried_through_pipes(tmp_path):
    spec = [*TINY, "task.environment=tests.ops.faulty_envs:overflowing_reward", "ops.max_nonfinite_steps=2"]
    result = _train(tmp_path, "subprocess", spec, raise_on_error=False)
    assert not result.success
    assert not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    failure = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"][0]
    assert "exited with 4" in str(failure.event_specific_data.error) and "not retried" in str(
        failure.event_specific_data.error)


def test_train_grpo_outside_pipes_needs_its_inputs(capsys):
    from factory.cli import main

    assert main(["train-grpo", SPEC]) == 2
    assert "not started by Dagster Pipes; give --init and --dataset" in capsys.readouterr().err


@pytest.mark.slow
def test_grpo_run_in_the_dagster_process_trains_two_ranks(tmp_path):
    # The asset's own process is no rank: each attempt of the run is a torchrun group of 2 ranks on this machine,
    # supervised from the asset (factory/runs/rank_group.py); the metadata is the same as for one process.
    result = _train(tmp_path, "in_process", [*TINY, "trainer.world_size=2", "trainer.strategy=ddp",
                                              "ops.preflight=off"])
    assert result.success
    md = result.asset_materializations_for_node("grpo_run")[0].metadata
    assert list(md) == GRPO_METADATA
    assert md["run_id"].value == f"pipes-{result.run_id[:8]}" and md["steps"].value == 4
    assert md["attempts"].value == 1 and Path(md["checkpoint"].value).is_dir()


@pytest.mark.slow
def test_a_supervised_launcher_trains_grpo_run_in_a_restartable_child_attempt(tmp_path):
    # launcher.where supervised: the asset's run is trained by attempts in child processes of the step (restarted as
    # `factory run`'s are), chosen by the launcher, not the asset; the metadata is the same. 76 s on 2 shared cores
    # (load ~9).
    result = _train(tmp_path, "supervised", [*TINY, "ops.preflight=off"])
    assert result.success
    md = result.asset_materializations_for_node("grpo_run")[0].metadata
    assert list(md) == GRPO_METADATA
    assert md["steps"].value == 4 and md["attempts"].value == 1
    with Lake.open(factory_home(str(tmp_path))) as lake:
        row = run_row(lake, md["run_id"].value)
    assert row["status"] == "succeeded" and row["pid"] != os.getpid()  # trained in a child attempt
