"""What the rollout server refuses, as OpenAI would, through the real `openai` client and raw sockets: an unknown
model (404 `model_not_found`), a body that is not UTF-8 or nested too deep (400 naming the byte), request headers
that never finish (closed with a 408), and a request its KV budget can never hold (400 naming the budget); and
that it goes on serving meanwhile. A real server of the micro model on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.server.app import launch_server
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer

HEADER_TIMEOUT_S = 0.5
STUCK_S = 30.0  # bounds that only turn a hang into a failure


@pytest.fixture(scope="module")
def server():
    torch.manual_seed(0)
    tok = build_tokenizer()
    engine = ContinuousEngine(build_model("micro", tok, seed=0, max_positions=256), tok, max_batch=4, name="micro",
                              kv_budget=100 * 512)  # 100 tokens of the micro model's K/V (512 bytes each)
    with launch_server(engine, model_names=["micro", "org/micro-v2"], header_timeout_s=HEADER_TIMEOUT_S) as h:
        yield h


def client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0, timeout=STUCK_S)


def test_an_unknown_model_is_a_404_model_not_found(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4o", prompt="1+2=", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    assert "`gpt-4o` does not exist" in e.value.message and "micro, org/micro-v2, policy" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="micro-v2", messages=[{"role": "user", "content": "1"}], max_tokens=1)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"
    # every served name, and `policy` (what Factory's environments send), is answered under its own name
    for name in ("micro", "org/micro-v2", "policy"):
        assert c.completions.create(model=name, prompt="1+2=", max_tokens=2).model == name
        assert c.models.retrieve(name).id == name
    assert [m.id for m in c.models.list().data] == ["micro", "org/micro-v2", "policy"]


def test_a_body_that_is_not_utf8_or_is_nested_too_deep_is_a_400_naming_the_byte(server):
    bad = httpx.post(server.url + "/v1/completions", content=b'{"model": "micro", "prompt": "1+2=\xff"}',
                     headers={"content-type": "application/json"}, timeout=STUCK_S)
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["message"] == "request body: invalid UTF-8 at byte 34 (JSON bodies must be UTF-8)"
    assert err["param"] == "body" and err["type"] == "invalid_request_error"
    head = b'{"model": "micro", "prompt": "1", "metadata": '
    deep = head + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(server.url + "/v1/chat/completions", content=deep, headers={"content-type": "application/json"},
                   timeout=STUCK_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    # the body's own brace is level 1: the 128th bracket opens level 129
    assert r.json()["error"]["message"] == \
        f"request body: JSON nested deeper than 128 levels (at byte {len(head) + 127})"


def test_request_headers_that_never_finish_are_closed_and_the_server_keeps_answering(server):
    """200 connections each send a request line and a header they never finish, a byte at a time; each is closed
    with a 408 while /health is answered and a request that arrived in full is not cut."""
    host, port = server.url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port)), timeout=STUCK_S) for _ in range(200)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    health = httpx.get(server.url + "/health", timeout=STUCK_S)
    assert health.status_code == 200
    answers = []
    for s in socks:
        s.settimeout(0.1)
        got, deadline = b"", time.monotonic() + STUCK_S
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                try:
                    s.sendall(b"a")  # one more byte of the header that never ends
                except OSError:
                    pass
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        else:
            raise AssertionError(f"a slow connection stayed open for {STUCK_S} s")
        answers.append(got)
        s.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers)
    r = client(server).completions.create(model="micro", prompt="1+2=", max_tokens=3)
    assert len(r.choices[0].token_ids) >= 1


def test_a_request_the_kv_budget_can_never_hold_is_a_400_naming_it(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:  # 60 prompt tokens + 30: 91 columns and a 60-token prefill
        c.completions.create(model="micro", prompt="1" * 59, max_tokens=30)
    assert "KV cache budget is 0.0 MiB (--kv-budget-mb (factory serve) / rollout.kv_budget_mb)" in e.value.message
    assert e.value.body["param"] == "max_tokens"
    info = httpx.get(server.url + "/get_server_info", timeout=STUCK_S).json()
    assert info["kv_budget_bytes"] == 100 * 512 and info["kv_token_bytes"] == 512
    # chat without max_tokens: as many as fit the context and the budget (the prompt's 21 tokens: 100 - 43 + 21)
    r = c.chat.completions.create(model="micro", messages=[{"role": "user", "content": "1+2=" * 5}],
                                  extra_body={"ignore_eos": True})
    assert len(r.choices[0].token_ids) == 100 - 2 * 21 - 1 and r.choices[0].finish_reason == "length"
    # and requests that fit wait for room: 4 of them, each near the whole budget, all answered
    waited = server.engine.stats.waited_for_kv
    results: list = []
    threads = [threading.Thread(target=lambda i=i: results.append(c.completions.create(
        model="micro", prompt="1+2=" * 5, max_tokens=50, seed=i, extra_body={"ignore_eos": True})))
        for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STUCK_S)
    assert len(results) == 4 and all(len(r.choices[0].token_ids) == 50 for r in results)
    assert server.engine.stats.waited_for_kv > waited  # one ran at a time (2 x 72 columns + a prefill > 100)
