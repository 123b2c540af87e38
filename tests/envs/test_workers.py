"""Environment workers: the same episodes score the same in the trainer's process and in worker processes."""

import os
import signal
import threading

import httpx
import pytest

from factory.envs.latency import LatencyProfile
from factory.envs.service import SCORERS, score_completions
from factory.envs.workers import Episode, LocalEnvironment, ServiceEnvironment, make_environment
from factory.infra.supervisor import CircuitOpen
from factory.problem import Problem

P = Problem(id="p1", prompt="12+30=", answer="24", op="add", digits=2)
EPISODES = [Episode(key=f"p1-{k}", problem=P, completions=["24", "42", " 24 ", ""]) for k in range(6)]


@pytest.fixture(scope="module")
def service():
    env = ServiceEnvironment(latency_unit_s=0.001, processes=2, timeout=60)
    yield env
    env.close()


@pytest.mark.slow
def test_service_scores_like_the_local_environment(service):
    local = LocalEnvironment(LatencyProfile(unit_s=0.001))
    assert service.score(EPISODES) == local.score(EPISODES)
    got = service.score(EPISODES)
    assert [s.rewards for s in got] == [[1.0, 0.0, 1.0, 0.0]] * 6
    assert [s.latency_s for s in got] == [LatencyProfile(unit_s=0.001).sample(e.key) for e in EPISODES]
    assert all(s.reasons == [None] * 4 for s in got)
    # it ran in another process, and counted what it ran
    assert sum(m["episodes"] for m in service.worker_metrics()) >= 12
    assert os.getpid() not in {m["pid"] for m in service.worker_metrics()}


def test_a_raising_or_unknown_environment_scores_zero_with_the_reason(service, monkeypatch):
    known = "['arithmetic', 'code', 'humaneval', 'math_verify', 'reasoning_gym', 'word_problems']"
    assert score_completions("nope", P.to_dict(), ["24"]) == ([0.0], [f"unknown env 'nope'; known: {known}"])
    monkeypatch.setitem(SCORERS, "broken", lambda problem, c: 1 / 0)
    assert score_completions("broken", P.to_dict(), ["24"]) == ([0.0],
                                                               ["reward raised ZeroDivisionError: division by zero"])
    (scored,) = service.score([Episode(key="x-0", problem=P, completions=["24"], env="nope")])
    assert scored.rewards == [0.0] and "unknown env 'nope'" in scored.reasons[0]


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_request_repeated(service):
    first = service.score(EPISODES[:1])
    restarts = sum(s.restarts for s in service.services)
    for s in service.services:
        s.kill(signal.SIGKILL)
    assert service.score(EPISODES[:1]) == first
    assert sum(s.restarts for s in service.services) == restarts + 1  # only the one the request went to


@pytest.mark.slow
def test_a_crash_looping_worker_trips_the_breaker_and_is_not_restarted():
    env = make_environment(0.0, "service", processes=1, timeout=60, breaker_restarts=1, breaker_window_s=3600.0)
    try:
        worker = env.services[0]
        first = env.score(EPISODES[:1])
        worker.kill(signal.SIGKILL)
        assert env.score(EPISODES[:1]) == first  # one restart within the window is allowed
        worker.kill(signal.SIGKILL)
        with pytest.raises(CircuitOpen, match=r"env-worker-0: circuit open: it died again \(exit -9\) after 1 "
                                              r"restarts within 3600s"):
            env.score(EPISODES[:1])
        assert worker.restarts == 1 and not worker.alive() and worker.breaker_open
    finally:
        env.close()


def test_a_bad_request_is_refused_naming_the_field(service):
    r = httpx.post(service.services[0].url + "/score", json={"episodes": [{"key": "k", "problem": {}}]})
    assert r.status_code == 422 and "completions" in r.text


def test_closing_wakes_a_waiting_local_episode():
    env = LocalEnvironment(LatencyProfile(unit_s=3600.0))  # an hour: only close() can end the wait
    out = []
    t = threading.Thread(target=lambda: out.append(env.score(EPISODES[:1])))
    t.start()
    env.close()
    t.join(timeout=30)
    assert not t.is_alive() and out == [None]


def test_unknown_medium_is_named():
    with pytest.raises(ValueError, match="rollout.environment"):
        make_environment(0.0, "cloud")
