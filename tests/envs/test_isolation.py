"""Failure isolation: a user's reward function or episode that raises, hangs past its timeout or returns garbage
scores that sample 0 with the reason, counts in `env_errors`, and leaves the good samples beside it and the
run's next requests untouched; in the trainer's process and through real env-serve worker processes.

The environments are real user code loaded by import path (tests/envs/isolation_envs.py); the multi-turn ones
talk to a real rollout server (a micro model on 127.0.0.1)."""

from __future__ import annotations

import decimal
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.server.app import launch_server
from factory.envs import protocol
from factory.envs.protocol import EpisodeResult, RewardResult, checked_reward
from factory.envs.service import SCORERS, score_completions
from factory.envs.workers import Episode, LocalEnvironment, ServiceEnvironment, make_environment
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem
from tests.envs import isolation_envs

REWARD = "tests.envs.isolation_envs:moody_reward"
EPISODE = "tests.envs.isolation_envs:scripted_episode"
GYM = "tests.envs.isolation_envs:MoodyGym"
REWARD_TIMEOUT_S = 2.0
EPISODE_TIMEOUT_S = 5.0
P = Problem(id="p1", prompt="12+30=", answer="42", op="add", digits=2)


def garbage(shown: str, type_name: str, what: str = "reward") -> str:
    return f"{what} returned {shown} ({type_name}), expected a finite number"


# completion -> (reward, reason): one batch mixing good samples with every kind of failure
SINGLE_TURN = {
    "1": (1.0, None),
    "raise": (0.0, "reward raised ValueError: cannot score '12+30='"),
    "0.5": (0.5, None),
    "hang": (0.0, f"reward timed out after {REWARD_TIMEOUT_S:g}s"),
    "nan": (0.0, garbage("nan", "float")),
    "inf": (0.0, garbage("inf", "float")),
    "str": (0.0, garbage("'abc'", "str")),
    "none": (0.0, garbage("None", "NoneType")),
    "list": (0.0, garbage("[1.0]", "list")),
    "exit": (0.0, "reward raised SystemExit: 3"),
    "result-nan": (0.0, garbage("nan", "float")),
    "true": (1.0, None),  # bools are accepted: True is 1.0
    "numpy": (0.25, None),
    "0": (0.0, None),
}
BAD = sum(1 for _, why in SINGLE_TURN.values() if why is not None)


@pytest.fixture(autouse=True)
def release_hung_calls(monkeypatch):
    """A fresh RELEASE per test, set at its end so the threads it abandoned in this process finish."""
    event = threading.Event()
    monkeypatch.setattr(isolation_envs, "RELEASE", event)
    yield
    event.set()


def wait_no_hung_calls() -> None:
    deadline = time.monotonic() + 30
    while protocol._hung_calls() and time.monotonic() < deadline:
        time.sleep(0.01)  # released threads finish their call; bounded poll
    assert protocol._hung_calls() == 0


def episodes() -> list[Episode]:
    return [Episode(key="iso-0", problem=P, completions=list(SINGLE_TURN), env=REWARD),
            Episode(key="iso-1", problem=P, completions=["1", "nan", "0.5"], env=REWARD)]


def check_single_turn(scored) -> None:
    first, second = scored
    assert list(zip(first.rewards, first.reasons, strict=True)) == list(SINGLE_TURN.values())
    assert second.rewards == [1.0, 0.0, 0.5] and second.reasons == [None, garbage("nan", "float"), None]


def test_values_a_reward_may_return():
    ok = [(1, 1.0), (0.5, 0.5), (True, 1.0), (False, 0.0), (np.float32(0.25), 0.25), (np.int64(2), 2.0),
          (torch.tensor(0.5), 0.5), (decimal.Decimal("0.75"), 0.75), (-1e300, -1e300)]
    for value, expected in ok:
        assert checked_reward(value) == RewardResult(expected), value
    refused = [(float("nan"), "nan (float)"), (float("-inf"), "-inf (float)"), ("1.0", "'1.0' (str)"),
               (b"1", "b'1' (bytes)"), (None, "None (NoneType)"), ([1.0], "[1.0] (list)"), ({}, "{} (dict)"),
               (1j, "1j (complex)"), (np.array([1.0, 2.0]), "array([1., 2.]) (ndarray)"),
               (torch.tensor(float("nan")), "tensor(nan) (Tensor)")]
    for value, shown in refused:
        assert checked_reward(value) == RewardResult(0.0, f"reward returned {shown}, expected a finite number")
    # a result object: its reward is checked, its info kept; an empty reason means scored normally
    assert checked_reward(RewardResult(0.5, "", {"k": 1})) == RewardResult(0.5, None, {"k": 1})
    assert checked_reward(EpisodeResult(1.0, "refused: too long")) == RewardResult(1.0, "refused: too long")
    assert checked_reward(RewardResult("x")).reason == garbage("'x'", "str")
    long = checked_reward("y" * 10_000).reason
    assert len(long) <= 300 and long.endswith("expected a finite number")


@pytest.mark.slow
def test_a_misbehaving_reward_function_scores_zero_with_the_reason_in_process():
    env = make_environment(0.0, "in_process", reward_timeout_s=REWARD_TIMEOUT_S)
    assert isinstance(env, LocalEnvironment) and env.metrics() == {"env_errors": 0.0}
    check_single_turn(env.score(episodes()))
    assert env.metrics() == {"env_errors": float(BAD + 1)}
    check_single_turn(env.score(episodes()))  # the run goes on: same scores, errors counted cumulatively
    assert env.metrics() == {"env_errors": float(2 * (BAD + 1))}
    env.close()


@pytest.mark.slow
def test_a_misbehaving_reward_function_scores_zero_with_the_reason_through_env_serve():
    env = make_environment(0.0, "service", processes=1, timeout=120, reward_timeout_s=REWARD_TIMEOUT_S)
    try:
        assert isinstance(env, ServiceEnvironment)
        check_single_turn(env.score(episodes()))
        assert env.metrics() == {"env_restarts": 0.0, "env_errors": float(BAD + 1)}
        (worker,) = env.worker_metrics()
        assert worker["failures"] == BAD + 1 and worker["in_flight"] == 0
        # the worker kept going after a hung call and a sys.exit() in user code: no restart was needed
        (again,) = env.score([Episode(key="iso-2", problem=P, completions=["1", "raise"], env=REWARD)])
        assert again.rewards == [1.0, 0.0] and again.reasons[0] is None
        assert env.metrics() == {"env_restarts": 0.0, "env_errors": float(BAD + 2)}
        assert env.services[0].restarts == 0 and env.services[0].alive()
    finally:
        env.close()


def test_the_worker_reads_its_reward_timeout_and_refuses_a_bad_one(monkeypatch):
    from factory.envs.service import create_app

    monkeypatch.setenv("FACTORY_REWARD_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="FACTORY_REWARD_TIMEOUT_S: expected seconds > 0, got 'soon'"):
        create_app()
    with pytest.raises(ValueError, match="task.reward_timeout_s: expected seconds > 0, got 0"):
        make_environment(0.0, "in_process", reward_timeout_s=0)


def test_hung_calls_are_bounded_and_the_bound_lifts_when_they_end(monkeypatch):
    wait_no_hung_calls()  # hung calls of earlier tests are released by now
    monkeypatch.setattr(protocol, "MAX_HUNG_CALLS", 2)
    rewards, reasons = score_completions(REWARD, P.to_dict(), ["hang", "1", "hang", "hang", "1"], timeout_s=0.5)
    assert rewards == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert reasons[:3] == ["reward timed out after 0.5s", None, "reward timed out after 0.5s"]
    assert reasons[3:] == ["reward not called: 2 earlier calls still run past their 0.5s timeout"] * 2
    isolation_envs.RELEASE.set()
    wait_no_hung_calls()
    assert score_completions(REWARD, P.to_dict(), ["1"], timeout_s=0.5) == ([1.0], [None])


def test_built_in_verifiers_run_as_before_inline_and_unbounded(monkeypatch):
    threads = []

    def recording(problem, completion):
        threads.append(threading.current_thread())
        return SCORERS["arithmetic"](problem, completion)

    monkeypatch.setitem(SCORERS, "recording", recording)
    assert score_completions("recording", P.to_dict(), ["42", "24", " 42 "], timeout_s=1e-9) == (
        [1.0, 0.0, 1.0], [None, None, None])  # a timeout that would fail any guarded call does not apply
    assert threads == [threading.current_thread()] * 3


# ------------------------------------------------------------------ multi-turn episodes


@pytest.fixture(scope="module")
def rollout_server():
    tok = build_tokenizer()
    with launch_server(ContinuousEngine(build_model("micro", tok, seed=0), tok, max_batch=16, name="micro")) as h:
        yield h


def tasks(*dos: str) -> list[dict]:
    return [{**P.to_dict(), "do": do, "sampling": {"temperature": 0.0, "max_tokens": 2}} for do in dos]


def sids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


TIMED_OUT = f"episode timed out after {EPISODE_TIMEOUT_S:g}s"
BLOCKED = TIMED_OUT + " (its event loop was blocked: blocking code in an async episode?)"
SCRIPTED = {
    "good": (1.0, None),
    "raise": (0.0, "episode raised ValueError: the episode broke"),
    "hang": (0.0, TIMED_OUT),
    "nan": (0.0, garbage("nan", "float", "episode")),
    "str": (0.0, garbage("'abc'", "str", "episode")),
    "none": (0.0, garbage("None", "NoneType", "episode")),
}
GYM_TASKS = {
    "good": (1.0, None),
    "hang_reset": (0.0, TIMED_OUT),  # reset/step run off the loop: a hang times out alone
    "hang_step": (0.0, TIMED_OUT),
    "raise_step": (0.0, "episode raised KeyError: 'no such state'"),
    "nan_step": (0.0, garbage("nan", "float", "episode step")),
    "str_step": (0.0, garbage("'1'", "str", "episode step")),
}


def outcomes(results: list[EpisodeResult]) -> list[tuple[float, str | None]]:
    return [(r.reward, r.reason) for r in results]


def check_episodes(env, rollout_server, name: str, table: dict, prefix: str) -> None:
    out = env.run_episodes(name, tasks(*table, "good"), sids(prefix, len(table) + 1), rollout_server.url,
                           EPISODE_TIMEOUT_S)
    assert outcomes(out) == [*table.values(), (1.0, None)]
    assert out[0].info["answer"] == out[-1].info["answer"]  # the good ones really talked to the model


@pytest.mark.slow
@pytest.mark.parametrize("medium", ["in_process", "service"])
def test_misbehaving_episodes_score_zero_with_the_reason(rollout_server, medium):
    env = make_environment(0.0, medium, processes=1, timeout=120)
    try:
        check_episodes(env, rollout_server, EPISODE, SCRIPTED, f"{medium}-scripted")
        check_episodes(env, rollout_server, GYM, GYM_TASKS, f"{medium}-gym")
        errors = sum(1 for _, why in (*SCRIPTED.values(), *GYM_TASKS.values()) if why is not None)
        assert env.metrics()["env_errors"] == errors
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("medium", ["in_process", "service"])
def test_an_episode_that_blocks_its_event_loop_times_out_and_the_next_group_runs(rollout_server, medium):
    env = make_environment(0.0, medium, processes=1, timeout=120)
    try:
        out = env.run_episodes(EPISODE, tasks("block", "block"), sids(f"{medium}-block", 2), rollout_server.url,
                               EPISODE_TIMEOUT_S)
        assert outcomes(out) == [(0.0, BLOCKED)] * 2
        if medium == "service":  # the worker's own event loop was never blocked: it still answers
            assert httpx.get(env.services[0].url + "/health").status_code == 200
        out = env.run_episodes(EPISODE, tasks("good"), sids(f"{medium}-after", 1), rollout_server.url,
                               EPISODE_TIMEOUT_S)
        assert outcomes(out) == [(1.0, None)]
        assert env.metrics()["env_errors"] == 2
    finally:
        env.close()
