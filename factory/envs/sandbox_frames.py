"""The framing host and sandbox worker speak, over the worker's stdin and stdout (both sides import it; the
worker gets its text from the pool, so it imports only the standard library).

A message is a 4-byte big-endian length, then UTF-8 JSON (`_send`/`_recv`). Requests: {"op": "ping"} ->
{"op": "pong"}; {"op": "exec", "limits"} followed by a body frame (`_body_frame`: code, stdin, files) ->
{"op": "result", "exit_code", "signal", "timed_out", "truncated", "stdout_bytes", "stderr_bytes",
"memory_error", "wall_s", "fault", "leftovers", "dirty"} followed by that many raw bytes of stdout, then of
stderr (`_recv_result` reads it all). The first message is {"op": "ready", "pid", "fresh", "why_not_fresh"}.
The body frame is read by the execution's own process, never by the worker (sandbox_worker.py says why).
"""

from __future__ import annotations

import json
import os
import select
import struct
import time
from typing import Any

_HEADER = struct.Struct(">I")
_MAX_MESSAGE = 256 << 20  # a request or reply larger than this is a protocol error


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _writev_all(fd: int, parts: list[bytes | memoryview]) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


def _send(fd: int, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    _write_all(fd, _HEADER.pack(len(body)) + body)


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd; None on EOF; TimeoutError past the deadline (None: wait forever)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError("no reply from the sandbox worker")
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(fd: int, deadline: float | None = None) -> dict[str, Any] | None:
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    (n,) = _HEADER.unpack(header)
    if n > _MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes is over the {_MAX_MESSAGE} byte limit")
    body = _read_exact(fd, n, deadline)
    if body is None:
        return None
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ValueError("message is not a JSON object")
    return msg


_BODY = struct.Struct(">III")  # a body frame: the lengths of the code, stdin and files parts, then the parts


def _body_frame(code: str, stdin: str, files: dict[str, str]) -> bytes:
    """The framed body of an exec request (host side): code and stdin as UTF-8 (surrogateescape keeps raw
    bytes), files as JSON when there are any. Not JSON as a whole: parsing it in each fresh child would cost
    it ~0.3 ms of copy-on-write faults."""
    parts = [code.encode("utf-8", "surrogateescape"), stdin.encode("utf-8", "surrogateescape"),
             json.dumps(files).encode() if files else b""]
    body = _BODY.pack(*map(len, parts)) + b"".join(parts)
    return _HEADER.pack(len(body)) + body


def _recv_body(fd: int) -> tuple[str, bytes, dict[str, str]] | None:
    """Read one body frame (the child, from the host's pipe): code, stdin bytes, files; None on EOF."""
    header = _read_exact(fd, _HEADER.size, None)
    if header is None:
        return None
    (n,) = _HEADER.unpack(header)
    if not _BODY.size <= n <= _MAX_MESSAGE:
        raise ValueError(f"body frame of {n} bytes")
    body = _read_exact(fd, n, None)
    if body is None:
        return None
    lens = _BODY.unpack_from(body)
    if _BODY.size + sum(lens) != n:
        raise ValueError("body frame parts do not add up")
    a, b = _BODY.size + lens[0], _BODY.size + lens[0] + lens[1]
    files = json.loads(body[b:]) if lens[2] else {}
    return body[_BODY.size:a].decode("utf-8", "surrogateescape"), body[a:b], files


def _recv_result(fd: int, deadline: float | None = None) -> dict[str, Any] | None:
    """A reply with its raw stdout and stderr after it, decoded into "stdout" and "stderr" (host side)."""
    msg = _recv(fd, deadline)
    if msg is None or msg.get("op") != "result":
        return msg
    sizes = [msg.pop("stdout_bytes"), msg.pop("stderr_bytes")]
    if not all(isinstance(n, int) and 0 <= n <= _MAX_MESSAGE for n in sizes):
        raise ValueError(f"bad output sizes {sizes!r} in a reply")
    raw = _read_exact(fd, sum(sizes), deadline) if sum(sizes) else b""
    if raw is None:
        return None
    msg["stdout"] = raw[:sizes[0]].decode("utf-8", "replace")
    msg["stderr"] = raw[sizes[0]:].decode("utf-8", "replace")
    return msg
