"""Environment workers (`factory env-serve`, a real process on 127.0.0.1) refuse bad requests with a 4xx naming
the field, an unreachable rollout server with a 502 naming rollout_url, and keep serving."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from factory.infra.supervisor import ServiceProcess
from tests.ports import refusing_port

P = {"id": "p1", "prompt": "12+30=", "answer": "42", "op": "add", "digits": 2}
GOOD_SCORE = {"episodes": [{"key": "p1-0", "problem": P, "completions": ["42", "7"]}]}


EPISODES = {"env": "calculator_tool", "tasks": [P], "session_ids": ["s1"], "rollout_url": "http://127.0.0.1:1",
            "timeout_s": 30}


def _raw(body: dict, replace: tuple[str, str]) -> bytes:
    text = json.dumps(body)
    assert replace[0] in text
    return text.replace(*replace).encode()


# (id, path, json body or raw bytes, status, field, words the message must hold)
CASES = [
    ("score-malformed-json", "/score", b'{"episodes": [', 422, "body", ["malformed JSON"]),
    ("score-not-an-object", "/score", b"[]", 422, "body", ["valid dictionary"]),
    ("score-episodes-type", "/score", {"episodes": 5}, 422, "episodes", ["valid list"]),
    ("score-missing-completions", "/score", {"episodes": [{"key": "k", "problem": {}}]}, 422,
     "episodes.0.completions", ["required"]),
    ("score-completion-type", "/score", {"episodes": [{"key": "k", "problem": P, "completions": ["a", 5]}]}, 422,
     "episodes.0.completions.1", ["valid string", "(got 5)"]),
    ("score-unknown-field", "/score", {"episodes": [{**GOOD_SCORE["episodes"][0], "rewards": [1]}]}, 422,
     "episodes.0.rewards", ["not permitted"]),
    ("score-huge-value-clipped", "/score", {"episodes": [{"key": "k", "problem": P, "completions": "c" * 100_000}]},
     422, "episodes.0.completions", ["valid list", "(100002 characters)"]),
    ("episodes-unknown-env", "/episodes", {**EPISODES, "env": "nope"}, 422, "env", ["unknown environment 'nope'"]),
    ("episodes-unimportable-env", "/episodes", {**EPISODES, "env": "no_such_pkg:run"}, 422, "env", ["cannot import"]),
    ("episodes-single-turn-env", "/episodes", {**EPISODES, "env": "arithmetic"}, 422, "env", ["single-turn"]),
    ("episodes-count-mismatch", "/episodes", {**EPISODES, "session_ids": []}, 422, "session_ids",
     ["1 tasks but 0 session_ids"]),
    ("episodes-task-type", "/episodes", {**EPISODES, "tasks": [5]}, 422, "tasks.0", ["valid dictionary"]),
    ("episodes-timeout-nan", "/episodes", _raw(EPISODES, ('"timeout_s": 30', '"timeout_s": NaN')), 422,
     "timeout_s", ["finite"]),
    ("episodes-timeout-inf", "/episodes", _raw(EPISODES, ('"timeout_s": 30', '"timeout_s": 1e999')), 422,
     "timeout_s", ["finite"]),
    ("episodes-timeout-negative", "/episodes", {**EPISODES, "timeout_s": -1}, 422, "timeout_s", ["greater than 0"]),
    ("episodes-timeout-huge", "/episodes", {**EPISODES, "timeout_s": 1e300}, 422, "timeout_s",
     ["less than or equal to"]),
    ("episodes-rollout-url-not-a-url", "/episodes", {**EPISODES, "rollout_url": "abc"}, 422, "rollout_url",
     ["http(s) URL"]),
    ("episodes-rollout-url-scheme", "/episodes", {**EPISODES, "rollout_url": "file:///etc"}, 422, "rollout_url",
     ["http(s) URL"]),
    ("episodes-rollout-unreachable", "/episodes", {**EPISODES, "rollout_url": f"http://127.0.0.1:{refusing_port()}"},
     502, "rollout_url", ["cannot reach the rollout server"]),
    ("unknown-route", "/scores", {}, 404, None, ["/scores"]),
    ("oversized", "/score", {"episodes": [{"key": "k", "problem": P, "completions": ["4" * (8 << 20)]}]}, 413,
     "body", ["byte limit"]),
]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("env-serve") / "service.log"
    argv = [sys.executable, "-m", "factory.cli", "env-serve", "--port", "{port}"]
    with ServiceProcess("env-serve", argv, log_path=log, startup_timeout=120) as svc:
        yield svc.url


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as c:  # keep-alive across the refusals
        yield c


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_naming_the_field(http, case):
    _, path, body, status, field, words = case
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["type"] != "internal_error", err
    assert all(w in err["message"] for w in words) and len(err["message"]) <= 500, err["message"]
    if field is not None:
        assert field.split(".")[0] in err["message"]
    good = http.post("/score", json=GOOD_SCORE)
    assert good.status_code == 200 and good.json()["episodes"][0]["rewards"] == [1.0, 0.0]


def test_an_unknown_env_in_score_still_scores_zero_with_the_reason(http):
    # /score keeps the in-process environment's behavior (tests/envs/test_workers.py): a 200 with a reason
    body = {"episodes": [{**GOOD_SCORE["episodes"][0], "env": "nope"}]}
    r = http.post("/score", json=body)
    assert r.status_code == 200 and r.json()["episodes"][0]["rewards"] == [0.0, 0.0]
    assert "unknown env 'nope'" in r.json()["episodes"][0]["reasons"][0]


@pytest.mark.slow
def test_env_serve_takes_the_body_limit_from_its_flag(tmp_path):
    argv = [sys.executable, "-m", "factory.cli", "env-serve", "--port", "{port}", "--max-body-mb", "0.01"]
    with ServiceProcess("env-serve", argv, log_path=tmp_path / "service.log", startup_timeout=120) as svc:
        big = {"episodes": [{"key": "k", "problem": P, "completions": ["4" * 20_000]}]}
        r = httpx.post(svc.url + "/score", json=big)
        assert r.status_code == 413 and "10485 byte limit" in r.json()["error"]["message"]
        assert httpx.post(svc.url + "/score", json=GOOD_SCORE).status_code == 200
