"""A JSON body's encoding and depth, checked on its bytes (`json_body.py`): what is refused and where, what is not
(brackets and escaped quotes inside strings), and through `guard` on a real uvicorn server: the refusal names the
body and the byte, raw paths and other content types pass untouched."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from factory.infra.http_guard import guard
from factory.infra.json_body import MAX_JSON_DEPTH, body_problem


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_invalid_utf8_is_refused_naming_its_byte():
    body = b'{"prompt": "caf\xc3\xa9 \xff\xfe"}'
    assert body_problem(body) == "request body: invalid UTF-8 at byte 18 (JSON bodies must be UTF-8)"
    assert body_problem('{"prompt": "café 中文 🙂"}'.encode()) is None


def test_depth_counts_only_brackets_outside_strings():
    assert body_problem(nested(MAX_JSON_DEPTH)) is None
    assert body_problem(nested(MAX_JSON_DEPTH + 1)) == \
        f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels (at byte {MAX_JSON_DEPTH})"
    assert body_problem(nested(100_000)) is not None
    # 100k brackets inside a string are text, also after escaped quotes and backslashes
    text = json.dumps({"a": 'x\\"' + "[" * 100_000, "b": "\\", "c": [[["{"]]]}).encode()
    assert body_problem(text) is None
    obj = b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1)
    assert "deeper than" in body_problem(obj)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = guard(FastAPI(), raw_paths=("/raw",))

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return {"keys": sorted(body)}

    @app.post("/raw")
    async def raw(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:  # no event for it in uvicorn; bounded poll
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


def test_through_the_guard_the_refusal_names_the_body_and_the_rest_passes(url):
    bad = httpx.post(url + "/echo", content=b'{"a": "\xff"}', headers={"content-type": "application/json"})
    assert bad.status_code == 422
    assert bad.json() == {"error": {"message": "request body: invalid UTF-8 at byte 7 (JSON bodies must be UTF-8)",
                                    "type": "invalid_request_error", "field": "body"}}
    deep = httpx.post(url + "/echo", content=b'{"a": ' + nested(100_000) + b"}")  # no content-type: read as JSON
    assert deep.status_code == 422 and "nested deeper than 128 levels" in deep.json()["error"]["message"]
    assert httpx.post(url + "/echo", json={"a": 1, "b": [[1]]}).json() == {"keys": ["a", "b"]}
    assert httpx.post(url + "/raw", content=b"\xff" + nested(1000)).json() == {"bytes": 2001}  # bytes, unchecked
    plain = httpx.post(url + "/echo", content=b"\xff", headers={"content-type": "text/plain"})
    assert plain.status_code == 422 and "invalid UTF-8" not in plain.text  # not JSON: FastAPI's own answer
