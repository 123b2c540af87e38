"""One assembly of the pipeline (`Pipeline`): the supervision a caller asks for is applied the same way whatever the
entry, so a sweep member asked to be supervised trains in restarted child attempts as `factory run` does, filed under
its sweep; the launcher resource is what the assets ask."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from factory.cockpit.tracking import Tracker
from factory.config import apply_overrides, load_spec
from factory.envs.spec_check import check_spec
from factory.runs.experiment import run_sweep_member
from factory.runs.pipeline import Pipeline
from factory.runs.supervision import Supervision
from resources import TrainingLauncherResource

BASE = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
TINY = {"name": "piped", "model.preset": "micro", "task.n_train": 200, "task.n_eval": 16, "sft.steps": 5,
        "sft.stop_at_accuracy": None, "rollout.prompts_per_step": 4, "algorithm.group_size": 2,
        "schedule.steps": 2, "schedule.eval_pass_k": 2, "trainer.threads": 1, "ops.preflight": "off"}


def spec(**more):
    return check_spec(apply_overrides(load_spec(BASE), {**TINY, **more}))


def test_supervision_is_what_the_caller_asked_save_the_two_cases_that_cannot_be(factory_home, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    said: list[str] = []
    one, two = Pipeline(spec(), factory_home, log=said.append), Pipeline(spec(**{"trainer.world_size": 2}),
                                                                            factory_home)
    assert one.supervision(Supervision.IN_PROCESS) == Supervision.IN_PROCESS
    assert one.supervision(Supervision.SUPERVISED) == Supervision.SUPERVISED
    assert two.supervision(Supervision.IN_PROCESS) == Supervision.SUPERVISED  # this process is no rank
    monkeypatch.setenv("RANK", "0")
    assert two.supervision(Supervision.IN_PROCESS) == Supervision.IN_PROCESS  # rank 0 trains here
    # a tpe trial is told each eval from this process: the run cannot go to a child
    assert one.supervision(Supervision.SUPERVISED, on_eval=lambda *a: None) == Supervision.IN_PROCESS
    assert said == ["the run reports its evals to this process (a tpe sweep's trial): it trains in this process"]


@pytest.mark.parametrize(("where", "supervision"), [("in_process", "in_process"), ("supervised", "supervised"),
                                                    ("subprocess", "in_process"), ("k8s", "in_process")])
def test_the_launcher_of_a_deployment_says_how_runs_trained_in_its_steps_are_supervised(where, supervision):
    assert TrainingLauncherResource(where=where).supervision() == supervision


@pytest.mark.slow
def test_a_supervised_sweep_member_trains_in_a_child_attempt_filed_under_its_sweep(factory_home, lake):
    # The micro model's dataset, 5 SFT steps, and 2 RL steps in one child attempt forked by the run's warm standby
    # (which imports the engine): 104 s with the 5 tests above on the shared 2-core machine at load ~8.
    res = run_sweep_member(spec(), factory_home, lake, Tracker(factory_home), "sup", "sup-m000", {"seed": 0},
                           sweep_name="sup", run_id="sup-m000-run", supervision=Supervision.SUPERVISED)
    assert res.run_id == "sup-m000-run" and res.steps == 2 and res.attempt == 1
    (run,) = lake.read("runs").to_pylist()
    assert run["status"] == "succeeded" and run["sweep_id"] == "sup"
    assert run["pid"] != os.getpid()  # trained by a supervised attempt, not by this process
    (row,) = lake.read("sweeps").to_pylist()
    assert (row["status"], row["run_id"], row["final_accuracy"]) == ("succeeded", "sup-m000-run", res.final_accuracy)
    # nested under the sweep's MLflow experiment, as an in-process member is
    mlflow_run = Tracker(factory_home).client.get_run(run["mlflow_run_id"])
    assert Tracker(factory_home).client.get_experiment(mlflow_run.info.experiment_id).name == "sup"
