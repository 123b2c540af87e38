"""tests/tcp_proxy.py, the proxy tests/models/test_uploads.py and benchmarks/upload_stall.py put in front of an S3
server: bytes pass both ways and the end of a stream is passed on; a gated proxy holds a connection, without
opening one upstream, until its gate is set; a negative delay is refused naming `delay_s`. Real sockets on
127.0.0.1."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from tests.tcp_proxy import TcpProxy

STUCK_S = 60.0  # only turns a hang into a failure


class Echo:
    """An upstream on 127.0.0.1 that sends back what it receives, counts the connections it accepted and calls
    `on_accept` (if set) as it accepts each."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = ("127.0.0.1", self.sock.getsockname()[1])
        self.accepted = 0
        self.on_accept: Callable[[], None] | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.on_accept is not None:
                self.on_accept()
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


@pytest.fixture
def echo() -> Iterator[Echo]:
    e = Echo()
    yield e
    e.sock.close()


def _exchange(port: int, payload: bytes) -> bytes:
    """Send `payload`, end the stream, and read until the other side ends it."""
    with socket.create_connection(("127.0.0.1", port), timeout=STUCK_S) as c:
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        got = b""
        while data := c.recv(65536):
            got += data
    return got


def test_bytes_pass_both_ways_and_the_end_of_the_stream_is_passed_on(echo):
    proxy = TcpProxy(echo.addr)
    try:
        payload = bytes(range(256)) * 1024  # several reads' worth
        assert _exchange(proxy.port, payload) == payload  # returns only because the EOF went through both ways
        assert proxy.reached.is_set() and echo.accepted == 1
    finally:
        proxy.close()


def test_a_gated_proxy_holds_the_connection_until_the_gate_opens(echo):
    proxy = TcpProxy(echo.addr, gated=True)
    gate_at_accept: list[bool] = []
    echo.on_accept = lambda: gate_at_accept.append(proxy.gate.is_set())
    result: dict[str, bytes] = {}
    sender = threading.Thread(target=lambda: result.update(got=_exchange(proxy.port, b"ping")))
    sender.start()
    try:
        assert proxy.reached.wait(STUCK_S)
        assert echo.accepted == 0 and "got" not in result  # held: nothing upstream, no answer
        proxy.gate.set()
        sender.join(STUCK_S)
        assert result["got"] == b"ping" and echo.accepted == 1
        assert gate_at_accept == [True]  # the upstream connection was opened only once the gate was
    finally:
        proxy.close()
        sender.join(STUCK_S)


def test_a_negative_delay_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"delay_s must be >= 0 seconds, got -1"):
        TcpProxy(("127.0.0.1", 9), delay_s=-1)


def test_down_cuts_open_connections_and_closes_new_ones_until_up(echo):
    proxy = TcpProxy(echo.addr)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=STUCK_S) as c:
            c.sendall(b"ping")
            assert c.recv(4) == b"ping"  # forwarded: the connection is open through the proxy
            assert proxy.down() == 1
            assert c.recv(4) == b""  # cut: the stream ends, as a stopped server ends it
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=STUCK_S) as c:
            assert c.recv(4) == b""  # while down a new connection is closed before a byte passes
        assert proxy.refused == 1 and echo.accepted == 1  # and none reached the upstream
        proxy.up()
        assert _exchange(proxy.port, b"back") == b"back" and echo.accepted == 2
    finally:
        proxy.close()
