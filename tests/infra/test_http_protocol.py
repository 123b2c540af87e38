"""uvicorn with `guarded_http`: connections that never finish their request headers (slowloris) are closed with a
408, oversize headers get a 431, idle connections close silently, and a request whose headers arrived is never
cut however long it takes; a real uvicorn server on 127.0.0.1, raw sockets for the slow clients."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from factory.infra.http_protocol import guarded_http

TIMEOUT_S = 0.5  # the header deadline under test; small, so the slow clients meet it quickly
STUCK_S = 30.0  # bounds that only turn a hang (no deadline at all) into a failure


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, asyncio.Event, asyncio.AbstractEventLoop]]:
    app = FastAPI()
    release = asyncio.Event()

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    @app.get("/held")
    async def held() -> dict:  # answers only once the test releases it
        await release.wait()
        return {"released": True}

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="off",
                                        http=guarded_http(TIMEOUT_S, max_header_bytes=4096)))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + STUCK_S
    while not srv.started:  # no event for it in uvicorn; bounded poll
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", release, srv.servers[0].get_loop()
    srv.should_exit = True
    thread.join(10)


def read_until_closed(sock: socket.socket, trickle: bytes = b"") -> bytes:
    """What the server sends before it closes `sock`; while it stays open, one more byte of `trickle` (a header
    line that never ends) goes out every 0.1 s. Fails if the server has not closed it within STUCK_S."""
    sock.settimeout(0.1)
    got, deadline, i = b"", time.monotonic() + STUCK_S, 0
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            if trickle:
                try:
                    sock.sendall(trickle[i % len(trickle): i % len(trickle) + 1])
                except OSError:  # closed while we were sending
                    continue
                i += 1
            continue
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the server kept the connection open for {STUCK_S} s; it sent {got[:200]!r}")


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=STUCK_S)


def test_slowloris_connections_are_closed_with_a_408_and_the_server_keeps_serving(server):
    url, _, _ = server
    socks = [connect(url) for _ in range(50)]
    for s in socks:
        s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # a header line that is never finished
    answers = [read_until_closed(s, trickle=b"abcdefgh") for s in socks]
    assert all(a.startswith(b"HTTP/1.1 408 ") and b"request headers not complete within 0.5 s" in a for a in answers)
    assert httpx.get(url + "/ok", timeout=STUCK_S).json() == {"ok": True}
    for s in socks:
        s.close()


def test_an_idle_connection_is_closed_silently_and_oversize_headers_get_a_431(server):
    url, _, _ = server
    idle = connect(url)
    assert read_until_closed(idle) == b""  # nothing sent, nothing answered: no 408 a client could misread
    big = connect(url)
    big.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000)
    assert read_until_closed(big).startswith(b"HTTP/1.1 431 ")
    idle.close()
    big.close()


def test_a_request_whose_headers_arrived_is_never_cut(server):
    url, release, loop = server
    with httpx.Client(base_url=url, timeout=STUCK_S) as client:
        assert client.get("/ok").status_code == 200
        result: dict = {}
        held = threading.Thread(target=lambda: result.update(r=httpx.get(url + "/held", timeout=STUCK_S)))
        held.start()
        # a slow client meets its deadline meanwhile: the held request has outlived a deadline when this returns
        slow = connect(url)
        slow.sendall(b"GET /ok HTTP/1.1\r\n")
        assert read_until_closed(slow, trickle=b"X").startswith(b"HTTP/1.1 408 ")
        assert held.is_alive()
        loop.call_soon_threadsafe(release.set)
        held.join(STUCK_S)
        assert result["r"].json() == {"released": True}
        assert client.get("/ok").status_code == 200
        slow.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="header_timeout_s"):
        guarded_http(0)
