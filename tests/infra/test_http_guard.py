"""The HTTP guard shared by Factory's services: error bodies naming the field, body limits, the 500 guard; a real
uvicorn server on 127.0.0.1 and one keep-alive client."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from factory.infra.http_guard import RequestError, field_path, guard, validation_message
from factory.text import clip


class Inner(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    x: float = Field(ge=0)


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    items: list[Inner] = []


def make_app() -> FastAPI:
    app = guard(FastAPI(), max_body_bytes=1024, body_limits={"/upload": 4096})

    @app.post("/echo")
    async def echo(body: Body) -> dict:
        if body.name == "missing":
            raise RequestError(404, f"no thing named {clip(body.name)!r}", "name", "not_found_error")
        if body.name == "bug":
            raise KeyError("y" * 5000)
        return {"name": body.name, "n": len(body.items)}

    @app.post("/upload")
    async def upload(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture(scope="module")
def http():
    server = uvicorn.Server(uvicorn.Config(make_app(), host="127.0.0.1", port=0, log_level="critical",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # no event for it in uvicorn; bounded poll
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield client
    server.should_exit = True
    thread.join(10)


def _ok(http: httpx.Client) -> None:
    r = http.post("/echo", json={"name": "a", "items": [{"x": 1}]})
    assert r.status_code == 200 and r.json() == {"name": "a", "n": 1}


def test_field_path():
    assert field_path(("body", "messages", 1, "tool_calls", 0, "function")) == "messages.1.tool_calls.0.function"
    assert field_path(("body", "prompt", "list[int]", 0)) == "prompt.0"
    assert field_path(("query", "version")) == "version"
    assert field_path(("body",)) is None


def test_validation_message_names_the_first_field_and_clips_values():
    errors = [{"type": "string_type", "loc": ("body", "name"), "msg": "Input should be a valid string",
               "input": "q" * 10_000}] * 5
    message, field = validation_message(errors)
    assert field == "name" and message.startswith("invalid request: name: Input should be a valid string (got")
    assert "and 2 more" in message and len(message) < 600


@pytest.mark.parametrize("body, status, field, words", [
    (b'{"name": ', 422, "body", ["malformed JSON"]),
    (b'{"name": 5}', 422, "name", ["valid string", "(got 5)"]),
    (b'{"name": "a", "extra": 1}', 422, "extra", ["not permitted"]),
    (b'{"name": "a", "items": [{"x": NaN}]}', 422, "items.0.x", ["finite", "(got nan)"]),
    (b'{"name": "a", "items": [{"x": -1}]}', 422, "items.0.x", ["greater than or equal to 0"]),
    (b'{"name": "missing"}', 404, "name", ["no thing named 'missing'"]),
    (b'{"name": "' + b"a" * 2000 + b'"}', 413, "body", ["1024 byte limit"]),
])
def test_bad_requests_get_a_4xx_naming_the_field(http, body, status, field, words):
    r = http.post("/echo", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["field"] == field and all(w in err["message"] for w in words), err
    _ok(http)


def test_per_path_body_limit_and_streamed_bodies(http):
    assert http.post("/upload", content=b"x" * 4000).json() == {"bytes": 4000}  # over the default, under its own
    r = http.post("/upload", content=b"x" * 5000)
    assert r.status_code == 413 and "4096 byte limit" in r.json()["error"]["message"]
    # no Content-Length: refused once the bytes received pass the limit
    r = http.post("/upload", content=iter([b"x" * 1000] * 50))
    assert r.status_code == 413 and r.json()["error"]["field"] == "body"
    assert http.post("/upload", content=iter([b"x" * 1000] * 3)).json() == {"bytes": 3000}
    _ok(http)


def test_unknown_routes_and_methods(http):
    r = http.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found: GET /nowhere"
    assert http.get("/echo").status_code == 405
    _ok(http)


def test_a_bug_is_a_short_500_on_a_connection_that_stays_usable(http):
    r = http.post("/echo", json={"name": "bug"})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_error" and err["message"].startswith("internal error: KeyError: 'yyy")
    assert len(err["message"]) <= 300
    _ok(http)
