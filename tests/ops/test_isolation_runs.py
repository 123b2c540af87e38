"""Failure isolation in whole runs: a part that fails takes down only its piece, and the run's records say so.

- a reward function that raises or hangs scores those samples 0 with the reason, and the run goes on;
- a rollout server that keeps crashing trips the circuit breaker: the run saves, stops naming the service
  and its last stderr lines, is `interrupted`, and resumes once the fault is gone;
- non-finite losses are skipped, and K in a row stop the run (`failed`, cause non_finite_loss).
"""

from __future__ import annotations

import pytest

from factory.cockpit.tracking import Tracker
from factory.config import parse_spec
from factory.core.loop import NonFiniteLoss
from factory.infra.supervisor import CircuitOpen
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem, Splits
from factory.runs.rl_run import run_rl

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(40)]
SPLITS = Splits(train=PROBLEMS[:32], eval=PROBLEMS[32:])


def spec(**over):
    base = {"name": "iso", "model": {"preset": "micro"}, "algorithm": {"group_size": 4, "lr": 1e-3},
            "rollout": {"prompts_per_step": 4, "max_new_tokens": 3}, "trainer": {"threads": 1},
            "schedule": {"steps": 4, "eval_pass_k": 2, "log_rollouts": 4, "wait_timeout_s": 60},
            "ops": {"resume_every": 2, "preflight": "off"}}
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value}
    return parse_spec(base)


@pytest.fixture
def init(factory_home):
    tok = build_tokenizer()
    return save_checkpoint(build_model("micro", tok, seed=0), tok, factory_home.checkpoints / "init").path


def run(s, factory_home, init, lake, run_id=None):
    return run_rl(s, factory_home, init, SPLITS, lake, Tracker(factory_home), log=lambda _: None, run_id=run_id)


@pytest.mark.slow
def test_a_raising_or_hanging_reward_scores_0_with_its_reason_and_the_run_goes_on(factory_home, init, lake):
    s = spec(task={"environment": "tests.ops.faulty_envs:flaky_reward", "reward_timeout_s": 0.5})
    res = run(s, factory_home, init, lake)
    assert lake.read("runs").to_pylist()[0]["status"] == "succeeded" and res.steps == 4
    steps = lake.read("steps").to_pylist()
    assert len(steps) == 4 and sum(r["env_errors"] for r in steps) > 0
    reasons = [r["reason"] for r in lake.read("rollouts").to_pylist() if r["reason"]]
    assert any(r.startswith("reward raised ValueError: the verifier broke") for r in reasons)
    assert any("timed out after 0.5s" in r for r in reasons)
    failed = [r for r in lake.read("rollouts").to_pylist() if r["reason"]]
    assert all(r["reward"] == 0.0 for r in failed)
    assert sum(r["env_errors"] for r in steps) == len(failed)  # every sample is in rollouts (log_rollouts = 4)


@pytest.mark.slow
def test_a_crash_looping_rollout_server_trips_the_breaker_then_the_run_resumes(factory_home, init, lake, monkeypatch):
    s = spec(schedule={"mode": "async"}, rollout={"engine": "server"}, buffer={"policy": "bound", "max_staleness": 2},
             ops={"breaker_restarts": 2, "breaker_window_s": 120})
    monkeypatch.setenv("FACTORY_FAULT_KILL", "serve_completion:1")  # every server dies on its first request
    with pytest.raises(CircuitOpen) as err:
        run(s, factory_home, init, lake, run_id="iso-loop")
    assert "rollout-server: circuit open" in str(err.value) and "after 2 restarts within 120s" in str(err.value)
    assert "Last lines of" in str(err.value) and "Uvicorn running" in str(err.value)  # its stderr tail
    row = lake.read("runs").to_pylist()[0]
    assert row["status"] == "interrupted" and "crash_loop" in row["error"] and "rollout-server" in row["error"]
    (cut,) = lake.read("interruptions").to_pylist()
    assert cut["cause"] == "crash_loop" and "rollout-server" in cut["detail"]
    monkeypatch.delenv("FACTORY_FAULT_KILL")  # fixed: the same run resumes and finishes
    res = run(s, factory_home, init, lake, run_id="iso-loop")
    row = lake.read("runs").to_pylist()[0]
    assert (row["status"], row["attempts"], res.steps) == ("succeeded", 2, 4)
    assert sorted(r["step"] for r in lake.read("steps").to_pylist()) == [1, 2, 3, 4]


@pytest.mark.slow
def test_non_finite_losses_are_skipped_and_k_in_a_row_stop_the_run(factory_home, init, lake):
    s = spec(task={"environment": "tests.ops.faulty_envs:overflowing_reward"}, ops={"max_nonfinite_steps": 2},
             schedule={"steps": 6})
    with pytest.raises(NonFiniteLoss, match="2 steps in a row .* non-finite loss"):
        run(s, factory_home, init, lake, run_id="iso-nan")
    row = lake.read("runs").to_pylist()[0]
    assert row["status"] == "failed" and "non_finite_loss" in row["error"]
    steps = sorted(lake.read("steps").to_pylist(), key=lambda r: r["step"])
    assert [r["nonfinite"] for r in steps][-2:] == [1.0, 1.0]
    (cut,) = lake.read("interruptions").to_pylist()
    assert cut["cause"] == "non_finite_loss" and cut["last_step"] == steps[-1]["step"]
    # The skipped updates left the weights as they were: the resume point holds the last good state.
    assert (factory_home.checkpoints / "iso-nan" / "resume" / f"step-{steps[-1]['step']:06d}").is_dir()

