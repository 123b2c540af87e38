"""Failure isolation for Factory's HTTP services (rollout server, environment workers, sandbox pool).

`guard(app, ...)` makes a FastAPI app answer every bad request with a 4xx whose JSON body names the field, a
server-side bug with a short 500, and go on serving:

- bodies over `max_body_bytes` (`body_limits` overrides it per path) get a 413: at once when Content-Length says
  so (the app never reads it; the server discards it as it arrives), else as soon as the bytes received pass the
  limit (it is never buffered whole). FastAPI's own `max_body_size` is not used: it answers a declared oversize
  with a plain-text body, whatever the app's error shape;
- validation errors (malformed JSON, wrong types, out-of-range or non-finite numbers) get `validation_status`
  naming the first error's field path (`messages.1.tool_calls.0.function`) and what was wrong; a JSON body that is
  not UTF-8 or is nested too deep gets it before it is parsed, naming the byte (`json_body.py`; `raw_paths`
  take bytes and are not checked);
- `RequestError` and Starlette's `HTTPException` (unknown route, wrong method) get their own status;
- any other exception gets a 500 "internal error: <type>: <message>", logged with its traceback; the response is
  a normal one, so the client's keep-alive connection stays usable.

Every error body is {"error": {"message": str, "type": str, "field": str | None}} (a service's `render` may add
keys: the rollout server adds OpenAI's `param` and `code`; a `RequestError` with a `code` sets `error.code`). A
value echoed in a message is clipped to 100 characters, and a message to 500.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from factory.infra.json_body import JSONBodyCheck
from factory.text import clip

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 8 << 20  # a JSON request body; a service raises it per path where it takes more (weight uploads)
MAX_MESSAGE = 500

# Renders an error body: (status, message, field, kind) -> JSON object.
Render = Callable[[int, str, str | None, str], dict[str, Any]]


class RequestError(Exception):
    """A request the service refuses: its status (4xx), a message for the caller and the field at fault."""

    def __init__(self, status: int, message: str, field: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field, self.kind, self.code = status, message, field, kind, code


def default_render(status: int, message: str, field: str | None, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "field": field}}


def field_path(loc: Sequence[Any]) -> str | None:
    """A pydantic/FastAPI error location as a dotted path without its source ("body", "query", ...) and without
    the union-member tags pydantic inserts (`prompt.list[int].0` -> `prompt.0`)."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    kept = [str(p) for p in parts if not _is_type_tag(p)]
    return ".".join(kept) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "tuple", "bytes", "set"}


def _is_type_tag(part: object) -> bool:
    if not isinstance(part, str):
        return False
    return ("[" in part or part in _TYPE_TAGS or part.startswith(("function-", "constrained-", "tagged-union"))
            or part in ("is-instance", "json-or-python", "lax-or-strict"))


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """A short message for pydantic/FastAPI validation errors and the first one's field path."""
    problems, first = [], None
    for i, err in enumerate(errors):
        loc = err.get("loc", ())
        path = field_path(loc)
        if i == 0:
            first = path or "body"
        if i >= 3:
            problems.append(f"and {len(errors) - 3} more")
            break
        if err.get("type") == "json_invalid":
            why = (err.get("ctx") or {}).get("error", "")
            pos = loc[-1] if loc and isinstance(loc[-1], int) else None
            problems.append(f"body: malformed JSON{f' at character {pos}' if pos is not None else ''}"
                            f"{f': {why}' if why else ''}")
            first = "body"
            continue
        text = f"{path or 'body'}: {err.get('msg', 'invalid')}"
        if err.get("type") != "missing" and "input" in err and not isinstance(err["input"], dict | list):
            text += f" (got {clip(_show(err['input']))})"
        problems.append(text)
    return "invalid request: " + "; ".join(problems), first


def _show(value: object) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan, inf: what the JSON said (NaN, Infinity, 1e999)
    return json.dumps(value) if isinstance(value, str | int | float | bool | None) else repr(value)


def error_response(status: int, message: str, field: str | None = None, kind: str | None = None,
                   render: Render = default_render, code: str | None = None) -> JSONResponse:
    kind = kind or ("internal_error" if status >= 500 else "invalid_request_error")
    body = render(status, clip(message, MAX_MESSAGE), field, kind)
    if code is not None and isinstance(body.get("error"), dict):
        body["error"]["code"] = code
    return JSONResponse(body, status_code=status)


def guard(app: FastAPI, *, validation_status: int = 422, render: Render = default_render,
          max_body_bytes: int = MAX_JSON_BYTES, body_limits: Mapping[str, int] | None = None,
          raw_paths: Collection[str] = ()) -> FastAPI:
    """Install the error handlers and the body and crash guards on `app` (before it serves); returns it."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return error_response(e.status, e.message, e.field, e.kind, render, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, field = validation_message(e.errors())
        return error_response(validation_status, message, field, None, render)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        if isinstance(e, _BodyTooLarge):
            return error_response(413, e.detail, "body", "request_too_large", render)
        message = e.detail if isinstance(e.detail, str) else json.dumps(e.detail, default=str)
        if e.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            message = f"{message}: {request.method} {clip(request.url.path)}"
        return error_response(e.status_code, message, getattr(e, "field", None), None, render)

    def refuse(message: str) -> JSONResponse:
        return error_response(validation_status, message, "body", None, render)

    app.add_middleware(JSONBodyCheck, refuse=refuse, raw_paths=raw_paths)  # inside the body limit
    # Added last = outermost: a crash anywhere inside (body limit included) becomes a 500 response.
    app.add_middleware(BodyLimit, default=max_body_bytes, per_path=dict(body_limits or {}), render=render)
    app.add_middleware(CatchAll, render=render)
    return app


class _BodyTooLarge(HTTPException):
    pass


class BodyLimit:
    """Refuse request bodies over a byte limit (ASGI middleware); see the module docstring."""

    def __init__(self, app: ASGIApp, default: int, per_path: Mapping[str, int], render: Render = default_render):
        self.app, self.default, self.per_path, self.render = app, default, per_path, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.per_path.get(scope["path"], self.default)
        message = f"the request body is over the {limit} byte limit of {scope['path']}"
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            # Refused unread: once the response is sent, uvicorn discards the rest of the body as it arrives.
            await error_response(413, message, "body", "request_too_large", self.render)(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(413, message)
            return msg

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class CatchAll:
    """Any exception out of the app becomes a short JSON 500 (traceback logged) instead of propagating to the
    server, which would log it and drop the client's connection. Exceptions after the response started are
    re-raised: there is no clean way to answer then."""

    def __init__(self, app: ASGIApp, render: Render = default_render):
        self.app, self.render = app, render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if started:
                raise
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            await error_response(500, f"internal error: {type(e).__name__}: {clip(str(e), 200)}", None,
                                 "internal_error", self.render)(scope, receive, send)
