"""A maximum-size body of token ids cannot stall the rollout server: it is refused (400 naming `prompt`) from its
raw bytes, before it is JSON-decoded and validated on the serving loop, while `/health` keeps being answered; an
acceptable token-id prompt still runs. Real server on 127.0.0.1; the route is wrapped only to record whether a
request reached it (i.e. was parsed)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from factory.core.rollout.server.api_models import MAX_PROMPTS
from factory.core.rollout.server.body_gate import MAX_OTHER_VALUES, max_values
from factory.infra.http_guard import MAX_JSON_BYTES

CONTEXT = 512  # the `served` fixture's context length (tests/core/conftest.py)
STUCK_S = 120.0  # only turns a hang into a failure; nothing here measures how fast anything is


@pytest.fixture
def reached(served) -> Iterator[list[Any]]:
    """The bodies that reached the completions route (were parsed and validated), in order."""
    _, srv = served
    real = srv.completions
    seen: list[Any] = []

    async def recording(request: Any, body: Any) -> dict:
        seen.append(body)
        return await real(request, body)

    srv.completions = recording
    try:
        yield seen
    finally:
        srv.completions = real


def _max_size_ids_body() -> bytes:
    """A `/v1/completions` body of token ids just under the default body limit (~4.2M ids)."""
    room = MAX_JSON_BYTES - 64
    return b'{"max_tokens": 1, "prompt": [' + b",".join([b"5"] * (room // 2)) + b"]}"


def test_a_max_size_token_id_body_is_refused_unparsed_while_health_answers(served, reached):
    handle, _ = served
    body = _max_size_ids_body()
    assert len(body) <= MAX_JSON_BYTES
    sent = threading.Event()
    result: dict[str, httpx.Response] = {}

    def chunks() -> Iterator[bytes]:
        # the first half, then wait until /health has been answered with this request in flight, then the rest
        yield body[: len(body) // 2]
        sent.set()
        assert health_done.wait(STUCK_S)
        yield body[len(body) // 2:]

    health_done = threading.Event()

    def send() -> None:
        result["big"] = httpx.post(handle.url + "/v1/completions", content=chunks(),
                                   headers={"content-type": "application/json"}, timeout=STUCK_S)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert sent.wait(STUCK_S)
        health = httpx.get(handle.url + "/health", timeout=STUCK_S)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert "big" not in result
    finally:
        health_done.set()
        sender.join(STUCK_S)
    r = result["big"]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt", err
    assert str(max_values(CONTEXT)) in err["message"] and "values" in err["message"], err
    assert reached == []  # refused from its bytes: never decoded, validated or tokenized
    # the server goes on serving
    assert httpx.get(handle.url + "/health", timeout=STUCK_S).json()["status"] == "ok"


def test_an_acceptable_token_id_prompt_still_runs(served, reached):
    handle, _ = served
    r = httpx.post(handle.url + "/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2, "seed": 0},
                   timeout=STUCK_S)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7, 8] and len(choice["token_ids"]) >= 1
    assert len(reached) == 1


def test_the_largest_acceptable_bodies_pass_the_bound(served, reached):
    """MAX_PROMPTS prompts of the longest length, commas in strings and the other fields' allowance: parsed, and
    refused (if at all) by the server's own checks, never by the byte bound."""
    handle, _ = served
    longest = [[5] * (CONTEXT - 1) for _ in range(MAX_PROMPTS)]
    other = {"stop_token_ids": [7] * (MAX_OTHER_VALUES - 64), "junk": ", , ," * 100_000}  # unknown: ignored
    body = json.dumps({"prompt": longest, "max_tokens": 2, **other}).encode()  # 2: one position too many
    assert body.count(b",") > max_values(CONTEXT)  # over the comma count: the precise count must be taken
    r = httpx.post(handle.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=STUCK_S)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
    assert len(reached) == 1
    texts = json.dumps({"prompt": ["a,\\\",b" * 1000] * MAX_PROMPTS, "max_tokens": 1,
                        "stop_token_ids": [7] * (MAX_OTHER_VALUES - 64)}).encode()
    r = httpx.post(handle.url + "/v1/completions", content=texts, headers={"content-type": "application/json"},
                   timeout=STUCK_S)
    assert r.status_code != 400 or "values" not in r.json()["error"]["message"], r.text
    assert len(reached) == 2


def test_more_prompts_than_max_prompts_are_refused_naming_prompt(served, reached):
    handle, _ = served
    r = httpx.post(handle.url + "/v1/completions", json={"prompt": [[5, 6]] * (MAX_PROMPTS + 1), "max_tokens": 1},
                   timeout=STUCK_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and f"at most {MAX_PROMPTS} prompts" in err["message"], err


def test_a_body_over_the_limit_is_still_a_413(served, reached):
    """The gate reads bodies inside the body limit: an oversize body sent without a Content-Length is a 413."""
    handle, _ = served
    big = b'{"prompt": "' + b"1" * MAX_JSON_BYTES + b'"}'

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    r = httpx.post(handle.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=STUCK_S)
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
    assert reached == []
