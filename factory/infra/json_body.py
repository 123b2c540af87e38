"""A JSON request body's encoding and nesting, checked on its raw bytes before the app parses it.

FastAPI answers a body that is not UTF-8, or nested past the recursion limit of Python's JSON reader, with a bare
"There was an error parsing the body" (its catch-all for anything but a JSON syntax error). `JSONBodyCheck` refuses
both first, with a message that says what and where: "request body: invalid UTF-8 at byte N", "request body: JSON
nested deeper than 128 levels (at byte N)". It checks the bodies FastAPI would parse as JSON (content-type
`application/json`, `+json`, or none), outside the paths that take raw bytes.

Depth is counted at C speed: only when the body holds more opening brackets than the limit (else it cannot be that
deep), the escaped backslashes and quotes are blanked (`\\\\` pairs first, then `\\"`, as a JSON reader pairs
them), so the remaining quotes delimit strings; numpy then sums the brackets outside strings.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_JSON_DEPTH = 128  # nesting of arrays and objects; tool schemas and content parts need a handful


def body_problem(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why `body` cannot be a JSON request (not UTF-8, or nested deeper than `max_depth`), or None."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"request body: invalid UTF-8 at byte {e.start} (JSON bodies must be UTF-8)"
    at = _too_deep_at(body, max_depth)
    if at is not None:
        return f"request body: JSON nested deeper than {max_depth} levels (at byte {at})"
    return None


def _too_deep_at(body: bytes, max_depth: int) -> int | None:
    """The byte offset of the first bracket that opens level `max_depth` + 1 outside strings, or None."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return None
    flat = body.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")  # same length: offsets stay the body's
    a = np.frombuffer(flat, dtype=np.uint8)
    outside = (np.cumsum(a == ord('"'), dtype=np.int32) & 1) == 0
    step = ((a == ord("[")) | (a == ord("{"))).astype(np.int32) - ((a == ord("]")) | (a == ord("}")))
    depth = np.cumsum(np.where(outside, step, 0), dtype=np.int32)
    deep = np.flatnonzero(depth > max_depth)
    return int(deep[0]) if deep.size else None


def _is_json(scope: Scope) -> bool:
    for key, value in scope.get("headers", ()):
        if key == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
    return True  # no content-type: FastAPI reads the body as JSON


class JSONBodyCheck:
    """ASGI middleware: reads a JSON request body whole (a body limit outside it bounds its size), answers it with
    `refuse(message)` when `body_problem` finds one, else hands it on to the app unchanged. Bodies of methods without
    one, of other content types, and of `raw_paths`, pass untouched."""

    def __init__(self, app: ASGIApp, refuse: Callable[[str], ASGIApp], raw_paths: Collection[str] = (),
                 max_depth: int = MAX_JSON_DEPTH):
        self.app, self.refuse, self.raw_paths, self.max_depth = app, refuse, frozenset(raw_paths), max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") \
                or scope["path"] in self.raw_paths or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        try:
            body, ended = await read_body(receive)
        except Exception as e:  # the body limit's 413: raised again where the app's error handlers answer it
            await self.app(scope, raising(e), send)
            return
        if ended is None and body and (problem := body_problem(body, self.max_depth)) is not None:
            await self.refuse(problem)(scope, receive, send)
            return
        await self.app(scope, replay(body, ended, receive), send)


async def read_body(receive: Receive) -> tuple[bytes, Message | None]:
    """The request body whole, and the message that stopped the reading before the body's end (a disconnect), if
    one did. What `receive` raises (a body limit's 413) propagates."""
    chunks: list[bytes] = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(chunks), msg
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            return b"".join(chunks), None


def replay(body: bytes, ended: Message | None, receive: Receive) -> Receive:
    """A receive that gives the buffered body as one message (then `ended`, if the client left), then defers to
    `receive` (which reports the client's disconnect)."""
    queue: list[Message] = [{"type": "http.request", "body": body, "more_body": ended is not None}]
    if ended is not None:
        queue.append(ended)

    async def replayed() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replayed


def raising(error: Exception) -> Receive:
    """A receive that raises `error`."""
    async def receive() -> Message:
        raise error

    return receive
