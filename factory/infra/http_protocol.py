"""uvicorn's HTTP protocol with a bound on how long and how large a request's head may be.

uvicorn times out only idle keep-alive connections (`timeout_keep_alive`, armed after a response and cancelled by
any byte received): a client that opens connections and sends their request lines and headers a byte at a time
(a slowloris) holds every one open for as long as it likes, and with httptools the header bytes are not bounded.
`guarded_http()` is the protocol class uvicorn would pick ("auto": httptools where installed, else h11) with a
deadline, armed when a connection opens and again after each response, that a request must complete its headers
by. Past it the connection is closed: with a 408 when part of a request had arrived, silently when nothing had (an
idle connection, as uvicorn closes idle keep-alive ones). Headers over `max_header_bytes` get a 431 and a close.
Once a request's headers are in, the deadline is off: a long request (a generation) is never cut.
Pass it as `uvicorn.Config(..., http=guarded_http())`.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 64 << 10


def guarded_http(header_timeout_s: float = HEADER_TIMEOUT_S,
                 max_header_bytes: int = MAX_HEADER_BYTES) -> type[asyncio.Protocol]:
    """The protocol class: uvicorn's own, with the head deadline and size bound of the module docstring."""
    if not header_timeout_s > 0 or max_header_bytes < 1:
        raise ValueError(f"header_timeout_s must be > 0 and max_header_bytes >= 1, got {header_timeout_s}, "
                         f"{max_header_bytes}")

    class GuardedHTTP(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None  # the request cycle current when the deadline was armed
        _head_bytes = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting = self._head_timer is not None
            if waiting:
                self._head_bytes += len(data)
            super().data_received(data)
            if not waiting or self.transport.is_closing():
                return
            if self.cycle is not self._head_cycle:  # a request's headers are complete
                self._disarm()
            elif self._head_bytes > max_header_bytes:
                self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                             f"request headers over {max_header_bytes} bytes")

        def on_response_complete(self) -> None:
            super().on_response_complete()
            idle = self.cycle is None or self.cycle.response_complete  # no pipelined request started instead
            if idle and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_cycle, self._head_bytes = self.cycle, 0
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.cycle is not self._head_cycle or self.transport.is_closing():
                return
            if self._head_bytes:
                self._refuse(HTTPStatus.REQUEST_TIMEOUT,
                             f"request headers not complete within {header_timeout_s:g} s")
            else:
                self.transport.close()

        def _refuse(self, status: HTTPStatus, message: str) -> None:
            self._disarm()
            body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                         "field": None, "code": None}}).encode()
            self.transport.write(f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
                                 f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
            self.transport.close()

    return GuardedHTTP
