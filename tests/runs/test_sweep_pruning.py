"""A tpe sweep's member pruned for real: a tiny member run reports its periodic held-out evals to its Optuna trial,
the median pruner finds it below the completed trials, and the run stops at a resume point, the trial is
pruned and the member's `sweeps` row says `pruned` with the reason."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from factory.cockpit.sweep import SweepDefinition
from factory.cockpit.sweep_search import TrialReporter, ask, open_storage, open_study, study_storage_url
from factory.cockpit.tracking import Tracker
from factory.config import apply_overrides, load_spec
from factory.envs.eval_suites import HELD_OUT
from factory.envs.spec_check import check_spec
from factory.runs.experiment import Pruned, run_sweep_member

BASE = Path(__file__).parents[2] / "examples" / "quickstart.yaml"
TINY = {"name": "prune-m002", "model.preset": "micro", "task.n_train": 200, "task.n_eval": 16, "sft.steps": 10,
        "sft.stop_at_accuracy": None, "rollout.prompts_per_step": 4, "algorithm.group_size": 2,
        "schedule.steps": 8, "schedule.eval_every": 2, "schedule.eval_pass_k": 2, "ops.resume_every": 2,
        "trainer.threads": 1, "ops.preflight": "off"}


@pytest.mark.slow
def test_a_member_below_the_completed_trials_is_pruned_at_a_resume_point(factory_home, lake):
    defn = SweepDefinition(base_spec=str(BASE), mode="tpe", trials=3, prune="median", prune_startup_trials=2,
                           space={"algorithm.lr": {"low": 1e-4, "high": 1e-3, "log": True}})
    study = open_study(open_storage(study_storage_url(factory_home, None)), "prune", defn.model_dump(mode="json"),
                       base_steps=8, eval_every=2)
    # Two completed trials that were perfect at every eval: a real member of this tiny model cannot be above them.
    dist = {"algorithm.lr": optuna.distributions.FloatDistribution(1e-4, 1e-3, log=True)}
    for lr in (2e-4, 5e-4):
        study.add_trial(optuna.trial.create_trial(params={"algorithm.lr": lr}, distributions=dist, value=1.0,
                                                  intermediate_values={2: 1.0, 4: 1.0, 6: 1.0}))
    asked = ask(study, defn.space, member_of=lambda n, params: f"prune-m{n:03d}")
    assert asked.number == 2
    spec = check_spec(apply_overrides(load_spec(BASE), {**TINY, **asked.params}))
    trial = TrialReporter(study, asked.trial_id, "median")

    res = run_sweep_member(spec, factory_home, lake, Tracker(factory_home), "prune", "prune-m002", asked.params,
                           sweep_name="prune", run_id="prune-m002-run", trial=trial)

    assert isinstance(res, Pruned) and res.run_id == "prune-m002-run"
    assert res.reason.startswith("median pruner at step 2: held-out accuracy ")
    assert "below the median 1.000 of 2 completed trial(s) at that step (diff -" in res.reason
    assert res.reason.endswith("n=16 each: outside the noise)")
    (row,) = lake.read("sweeps").to_pylist()
    assert (row["member"], row["status"], row["reason"], row["run_id"]) == ("prune-m002", "pruned", res.reason,
                                                                            "prune-m002-run")
    # The study: the trial is pruned with the value it reported at step 2 (the held-out eval in the lake).
    frozen = study.get_trials()[2]
    evals = {r["step"]: r["value"] for r in lake.read("evals").to_pylist()
             if r["benchmark"] == HELD_OUT and r["metric"] == "accuracy"}
    assert frozen.state == optuna.trial.TrialState.PRUNED
    assert frozen.intermediate_values == {2: evals[2]}
    # The run stopped right after step 2, at a resume point of step 2: resumable, not failed.
    # Its status is `pruned` everywhere (issue 32): the run's row, and its MLflow run (ended as meant: FINISHED)
    (run,) = lake.read("runs").to_pylist()
    (cut,) = lake.read("interruptions").to_pylist()
    assert (run["status"], cut["cause"], cut["last_step"]) == ("pruned", "pruned", 2)
    mlflow_run = Tracker(factory_home).get_run(run["mlflow_run_id"])
    assert (mlflow_run.info.status, mlflow_run.data.tags["factory.status"]) == ("FINISHED", "pruned")
    assert max(r["step"] for r in lake.read("steps").to_pylist()) == 2
    resume = factory_home.checkpoints / "prune-m002-run" / "resume"
    assert sorted(p.name for p in resume.iterdir())[-1] == "step-000002"


@pytest.mark.slow
def test_a_member_whose_run_worker_died_is_interrupted_like_its_run_not_failed(factory_home, lake, monkeypatch):
    """Issue 32: a member stopped at a resume point because its Dagster run worker died (the retry resumes it) said
    `failed` in `sweeps` while its run said `interrupted`. Here the trainer's supervisor (the run worker) is gone from
    its second GRPO step on: it stops at a resume point after that step, as a killed worker's orphan does (~25 s)."""
    from factory.core.loop import RunInterrupted
    from factory.runs.attempt import SUPERVISOR_ENV

    monkeypatch.delenv(SUPERVISOR_ENV, raising=False)

    def progress(p) -> None:
        if p.phase == "grpo" and p.step >= 1:  # a pid that is neither this process's parent nor grandparent
            monkeypatch.setenv(SUPERVISOR_ENV, "999999999")

    spec = check_spec(apply_overrides(load_spec(BASE), {**TINY, "name": "killed-m000"}))
    with pytest.raises(RunInterrupted):
        run_sweep_member(spec, factory_home, lake, Tracker(factory_home), "killed", "killed-m000", {}, sweep_name="k",
                         run_id="killed-m000-run", progress=progress)
    (row,) = lake.read("sweeps").to_pylist()
    (run,) = lake.read("runs").to_pylist()
    (cut,) = lake.read("interruptions").to_pylist()
    assert (row["status"], run["status"], cut["cause"]) == ("interrupted", "interrupted", "supervisor_lost")
