"""A large prompt cannot stall the rollout server: one longer (in characters) than the context could hold is
refused before it is tokenized, and a large one that must be tokenized is tokenized off the serving loop, so
`/health` answers while it is. Real server on 127.0.0.1; the tokenizer is the real one, wrapped to record what it
is asked to encode and to hold a large encode until the test has seen `/health` answer."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

CONTEXT = 4096  # the `served` fixture's context length (tests/core/conftest.py)
BIG = 3 * CONTEXT  # characters: more than the context in tokens, fewer than it could hold at 5 chars a token
# Generous bounds that only turn a hang into a failure; nothing here measures how fast anything is.
STUCK_S = 60.0


class HoldingTokenizer:
    """The real tokenizer; an encode of a text of `BIG` characters or more is recorded, says so through
    `entered`, and waits for `release`."""

    def __init__(self, tok: Any):
        self._tok = tok
        self.big_calls: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str) and len(text) >= BIG:
            self.big_calls.append(len(text))
            self.entered.set()
            self.release.wait(STUCK_S)
        return self._tok(text, *args, **kwargs)


@pytest.fixture
def holding(served):
    handle, srv = served
    real = srv.tokenizer
    wrapper = HoldingTokenizer(real)
    srv.tokenizer = wrapper
    srv.template.tokenizer = wrapper
    try:
        yield wrapper
    finally:
        wrapper.release.set()
        srv.tokenizer = real
        srv.template.tokenizer = real


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(served, holding, endpoint):
    handle, srv = served
    too_long = "1" * (srv.max_prompt_chars + 1)
    body: dict = ({"prompt": too_long, "max_tokens": 1} if endpoint == "completions" else
                  {"messages": [{"role": "user", "content": too_long}], "max_tokens": 1})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    holding.release.set()  # were it tokenized (the defect), do not hold it
    r = httpx.post(handle.url + path, json=body, timeout=STUCK_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == ("prompt" if endpoint == "completions" else "messages")
    assert "characters" in err["message"] and str(CONTEXT) in err["message"], err
    assert holding.big_calls == []  # never tokenized
    # one just inside the bound is tokenized, then refused by the context length
    ok = "1" * srv.max_prompt_chars
    r = httpx.post(handle.url + "/v1/completions", json={"prompt": ok, "max_tokens": 1}, timeout=STUCK_S)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert holding.big_calls == [len(ok)]


def test_health_answers_while_a_large_prompt_is_tokenized(served, holding):
    handle, srv = served
    assert BIG <= srv.max_prompt_chars  # this one passes the character bound: it must be tokenized
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        result["big"] = httpx.post(handle.url + "/v1/completions", json={"prompt": "1" * BIG, "max_tokens": 1},
                                   timeout=2 * STUCK_S)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert holding.entered.wait(STUCK_S), "the large prompt never reached the tokenizer"
        # The large prompt is being tokenized (held there): the server must still answer.
        health = httpx.get(handle.url + "/health", timeout=STUCK_S)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert "big" not in result  # it answered while the large prompt was still in flight
    finally:
        holding.release.set()
        sender.join(2 * STUCK_S)
    r = result["big"]
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
    # and the server keeps serving ordinary requests
    r = httpx.post(handle.url + "/v1/completions", json={"prompt": "1+2=", "max_tokens": 2, "seed": 0},
                   timeout=STUCK_S)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1
