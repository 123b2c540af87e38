"""The rollout server refuses bad requests with a 4xx naming the field, answers a server-side bug with a short 500,
and keeps serving: real server on 127.0.0.1, one keep-alive httpx client for the whole table."""

from __future__ import annotations

import sys

import httpx
import pytest

from factory.core.rollout.engines.continuous import ContinuousEngine
from factory.core.rollout.server.app import launch_server
from factory.infra.supervisor import ServiceProcess
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer

MAX_BODY = 64 << 10
MAX_UPDATE = 256 << 10
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = {"role": "user", "content": "1+2="}


def _turn(tool_calls: object) -> dict:
    return {"messages": [USER, {"role": "assistant", "content": "x", "tool_calls": tool_calls},
                         {"role": "user", "content": "3"}], "max_tokens": 2}


def _raw(body: str) -> bytes:
    return body.encode()


# (id, method, path, json body or raw bytes, status, field, words the message must hold)
CASES = [
    # known defects: malformed tool_calls were a 500 with a traceback
    ("tool_calls-int", "POST", CHAT, _turn([5]), 400, "messages.1.tool_calls.0", ["valid dictionary"]),
    ("tool_calls-str", "POST", CHAT, _turn("abc"), 400, "messages.1.tool_calls", ["valid list"]),
    ("tool_calls-function-int", "POST", CHAT, _turn([{"function": 5}]), 400, "messages.1.tool_calls.0.function",
     ["valid dictionary"]),
    ("tool_calls-no-name", "POST", CHAT, _turn([{"function": {"arguments": "{}"}}]), 400,
     "messages.1.tool_calls.0.function.name", ["required"]),
    ("tool_calls-bad-arguments", "POST", CHAT, _turn([{"function": {"name": "f", "arguments": "{oops"}}]), 400,
     "messages.1.tool_calls.0.function.arguments", ["JSON object"]),
    ("tool_calls-array-arguments", "POST", CHAT, _turn([{"function": {"name": "f", "arguments": "[1]"}}]), 400,
     "messages.1.tool_calls.0.function.arguments", ["JSON object"]),
    # known defects: non-finite temperature was 1.0 (NaN) or uniform sampling (inf); NaN timeouts were accepted
    ("temperature-nan", "POST", CHAT, _raw('{"messages": [{"role": "user", "content": "1"}], "temperature": NaN}'),
     400, "temperature", ["finite"]),
    ("temperature-inf", "POST", CHAT,
     _raw('{"messages": [{"role": "user", "content": "1"}], "temperature": Infinity}'), 400, "temperature",
     ["finite"]),
    ("temperature-1e999", "POST", COMP, _raw('{"prompt": "1+2=", "temperature": 1e999}'), 400, "temperature",
     ["finite"]),
    ("top_p-nan", "POST", COMP, _raw('{"prompt": "1+2=", "top_p": NaN}'), 400, "top_p", ["finite"]),
    ("logit_bias-nan", "POST", COMP, _raw('{"prompt": "1+2=", "logit_bias": {"5": NaN}}'), 400, "logit_bias.5",
     ["finite"]),
    ("pause-timeout-nan", "POST", "/pause_generation", _raw('{"wait": true, "timeout": NaN}'), 400, "timeout",
     ["finite"]),
    ("pause-timeout-inf", "POST", "/pause_generation", _raw('{"wait": true, "timeout": 1e999}'), 400, "timeout",
     ["finite"]),
    ("pause-timeout-negative", "POST", "/pause_generation", {"wait": True, "timeout": -1}, 400, "timeout",
     ["greater than or equal to 0"]),
    ("pause-mode", "POST", "/pause_generation", {"mode": "abort"}, 400, "mode", ["drain"]),
    # out-of-range numbers
    ("max_tokens-negative", "POST", COMP, {"prompt": "1+2=", "max_tokens": -5}, 400, "max_tokens", ["at least 1"]),
    ("max_completion_tokens-negative", "POST", CHAT, {"messages": [USER], "max_completion_tokens": -1}, 400,
     "max_completion_tokens", ["at least 1"]),
    ("n-too-large", "POST", COMP, {"prompt": "1+2=", "n": 100_000}, 400, "n", ["[1, 256]"]),
    ("n-zero", "POST", CHAT, {"messages": [USER], "n": 0}, 400, "n", ["[1, 256]"]),
    ("top_logprobs", "POST", CHAT, {"messages": [USER], "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs",
     ["[0, 20]"]),
    ("stop_token_ids-negative", "POST", COMP, {"prompt": "1+2=", "stop_token_ids": [-1]}, 400, "stop_token_ids.0",
     ["greater than or equal to 0"]),
    ("prompt-token-out-of-vocab", "POST", COMP, {"prompt": [10 ** 30], "max_tokens": 2}, 400, "prompt", ["[0, "]),
    ("context-too-long", "POST", COMP, {"prompt": "1+2=", "max_tokens": 10 ** 20}, 400, "max_tokens",
     ["maximum context length"]),
    # malformed bodies and wrong types
    ("malformed-json", "POST", COMP, _raw('{"prompt": "1+2=",'), 400, "body", ["malformed JSON"]),
    ("not-an-object", "POST", CHAT, _raw("[1, 2]"), 400, "body", ["valid dictionary"]),
    ("empty-body", "POST", CHAT, _raw(""), 400, "body", ["required"]),
    ("messages-type", "POST", CHAT, {"messages": "hi"}, 400, "messages", ["valid list"]),
    ("message-not-object", "POST", CHAT, {"messages": [USER, 5]}, 400, "messages.1", ["valid dictionary"]),
    ("role", "POST", CHAT, {"messages": [{"role": "robot", "content": "1"}]}, 400, "messages.0.role", ["robot"]),
    ("content-type", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", []),
    ("content-part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content", ["text parts"]),
    ("prompt-type", "POST", COMP, {"prompt": [[1, 2], "x"]}, 400, "prompt", []),
    ("max_tokens-type", "POST", COMP, {"prompt": "1+2=", "max_tokens": "many"}, 400, "max_tokens", ["integer"]),
    ("disk-model_path-type", "POST", "/update_weights_from_disk", {"model_path": 5}, 400, "model_path", ["string"]),
    ("disk-weight_version", "POST", "/update_weights_from_disk", {"model_path": "/x", "weight_version": "abc"}, 400,
     "weight_version", ["integer"]),
    ("disk-version-negative", "POST", "/update_weights_from_disk", {"model_path": "/x", "version": -1}, 400,
     "version", ["greater than or equal to 0"]),
    ("disk-weight_version-negative", "POST", "/update_weights_from_disk", {"model_path": "/x", "weight_version": "-5"},
     400, "weight_version", ["integer in [0, "]),
    ("delta-version", "POST", "/update_weights_from_delta?version=abc", b"x", 400, "version", ["integer"]),
    ("delta-version-negative", "POST", "/update_weights_from_delta?version=-1", b"x", 400, "version",
     ["greater than or equal to 0"]),
    ("delta-mode", "POST", "/update_weights_from_delta?mode=zzz", b"x", 400, "mode", ["finish_old"]),
    # unknown names
    ("unknown-session", "GET", "/sessions/" + "s" * 5000, None, 404, "session_id", ["no session"]),
    ("unknown-session-delete", "DELETE", "/sessions/nope", None, 404, "session_id", ["nope"]),
    ("unknown-route", "POST", "/v1/nothing", {}, 404, None, ["/v1/nothing"]),
    ("wrong-method", "GET", COMP, None, 405, None, ["Method Not Allowed"]),
    # oversized bodies: refused before they are read
    ("oversized-json", "POST", CHAT, {"messages": [{"role": "user", "content": "1" * MAX_BODY}]}, 413, "body",
     [f"{MAX_BODY} byte limit"]),
    ("oversized-update", "POST", "/update_weights_from_delta", b"\0" * (MAX_UPDATE + 1), 413, "body",
     [f"{MAX_UPDATE} byte limit"]),
]


def make_engine() -> ContinuousEngine:
    tok = build_tokenizer()
    return ContinuousEngine(build_model("micro", tok, seed=0), tok, max_batch=16, name="micro")


@pytest.fixture(scope="module")
def server():
    with launch_server(make_engine(), max_body_bytes=MAX_BODY, max_update_bytes=MAX_UPDATE) as handle:
        yield handle


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:  # keep-alive: refusals must not break the connection
        yield c


def _send(http: httpx.Client, method: str, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"content-type": "application/json"})
    return http.request(method, path, json=body) if body is not None else http.request(method, path)


def _still_serves(http: httpx.Client) -> None:
    http.post("/continue_generation")  # a pause case may have paused it
    r = http.post(COMP, json={"prompt": "1+2=", "max_tokens": 2, "seed": 0})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_naming_the_field(http, case):
    _, method, path, body, status, field, words = case
    r = _send(http, method, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and err["param"] == field, err  # OpenAI's name for it too
    assert err["type"] != "internal_error" and r.json()["message"] == err["message"]
    for w in words:
        assert w in err["message"], err["message"]
    if field is not None:
        assert field.split(".")[0] in err["message"], err["message"]
    assert len(err["message"]) <= 500  # never a huge value echoed whole
    _still_serves(http)


def test_the_openai_client_sees_a_bad_request(server):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError, match=r"messages\.1\.tool_calls\.0\.function"):
        c.chat.completions.create(model="micro", **_turn([{"function": 5}]))


def test_a_chunked_oversized_body_is_refused_while_it_streams(http):
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(64):  # 4 MiB if it were all read
            sent += 1
            yield b" " * (64 << 10)

    r = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"
    _still_serves(http)


def test_a_server_side_bug_is_a_short_500_and_the_server_goes_on(server, http, monkeypatch):
    def broken() -> dict:
        raise ZeroDivisionError("x" * 10_000)

    monkeypatch.setattr(server.app.state.rollout, "model_info", broken)  # a bug injected in the live server
    r = http.get("/get_model_info")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_error" and err["message"].startswith("internal error: ZeroDivisionError: xxx")
    assert len(err["message"]) <= 500
    monkeypatch.undo()
    assert http.get("/get_model_info").status_code == 200  # same keep-alive connection
    _still_serves(http)


@pytest.mark.slow
def test_factory_serve_takes_the_body_limits_from_its_flags(tmp_path):
    argv = [sys.executable, "-m", "factory.cli", "serve", "--preset", "micro", "--port", "{port}", "--threads", "1",
            "--max-body-mb", "0.01", "--max-update-mb", "0.02"]
    with ServiceProcess("serve", argv, log_path=tmp_path / "serve.log", startup_timeout=120) as svc:
        r = httpx.post(svc.url + COMP, json={"prompt": "1" * 20_000})
        assert r.status_code == 413 and "10485 byte limit" in r.json()["error"]["message"]
        r = httpx.post(svc.url + "/update_weights_from_delta", content=b"\0" * 30_000)
        assert r.status_code == 413 and "20971 byte limit" in r.json()["error"]["message"]
        assert httpx.post(svc.url + COMP, json={"prompt": "1+2=", "max_tokens": 2}).status_code == 200
