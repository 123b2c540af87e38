"""The rollout server's bound on a `/v1/completions` body, checked on its raw bytes before it is parsed.

A prompt of token ids costs the serving loop its JSON decoding and pydantic validation, about a microsecond per
id with the GIL held (an 8 MiB body of ~4M ids: seconds), before its length can be checked. Every JSON value past
a container's first is preceded by a comma outside any string, so the number of such commas bounds what parsing
costs; `bytes.count` and `bytes.split` find them at C speed in a pass over the body.

An acceptable request holds at most `max_values(max_seq_len)` commas outside strings and `MAX_STRINGS` strings:
its prompt is one string, or at most `MAX_PROMPTS` strings, or at most `MAX_PROMPTS` lists of fewer than
`max_seq_len` token ids (the completion needs at least one position): fewer than `MAX_PROMPTS * max_seq_len` commas
and `MAX_PROMPTS` strings. Its other fields (the sampling fields, `stop` and `stop_token_ids`, unknown fields,
which are accepted and ignored; their keys included) may hold `MAX_OTHER_VALUES` values: each adds at most one
comma and at most one string. So a body over either count is refused with a 400 naming `prompt`, which no request
the server would run could be; one within them goes on to be parsed, and the prompt's own checks follow
(`MAX_PROMPTS`, the character bound, the context length).

Counting commas outside strings: JSON strings are delimited by unescaped quotes. Removing each `\\\\` pair, then
each `\\"`, left to right, leaves exactly the unescaped quotes (a backslash in valid JSON starts an escape, so
pairing a run of backslashes from its start is how a JSON reader reads it); splitting at them, every other piece
is a string's inside. The split runs only on a body over the comma count and with at most `MAX_STRINGS` strings,
so it makes at most `2 * MAX_STRINGS + 1` pieces. Invalid JSON may be counted wrongly; it is refused either way.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from factory.core.rollout.server.api_models import MAX_PROMPTS, _error_response
from factory.infra.json_body import raising, read_body, replay

MAX_OTHER_VALUES = 1 << 16  # values (keys included) a request may hold outside its prompt
MAX_STRINGS = MAX_PROMPTS + MAX_OTHER_VALUES


def max_values(max_seq_len: int) -> int:
    """The most commas outside strings an acceptable `/v1/completions` body can hold (see the module docstring)."""
    return MAX_PROMPTS * max_seq_len + MAX_OTHER_VALUES


def body_problem(body: bytes, max_seq_len: int) -> str | None:
    """Why `body` (a `/v1/completions` request) holds more than any acceptable request could, or None."""
    commas = body.count(b",")
    limit = max_values(max_seq_len)
    if commas <= limit:  # the common case: one C-speed pass
        return None
    flat = _unescaped(body)
    strings = flat.count(b'"') // 2
    if strings > MAX_STRINGS:
        return (f"prompt: the request holds {strings} strings; one this server can run holds at most {MAX_STRINGS} "
                f"({MAX_PROMPTS} prompts and {MAX_OTHER_VALUES} values in its other fields)")
    outside = commas - _commas_in_strings(flat)
    if outside <= limit:
        return None
    return (f"prompt: the request holds about {outside} values; one this server can run holds at most {limit} "
            f"(at most {MAX_PROMPTS} prompts of fewer than {max_seq_len} token ids, the maximum context length, and "
            f"{MAX_OTHER_VALUES} values in its other fields)")


def commas_outside_strings(body: bytes) -> int:
    """The commas of a JSON text that are not inside a string (one fewer than the values of each non-empty
    container, summed)."""
    return body.count(b",") - _commas_in_strings(_unescaped(body))


def _unescaped(body: bytes) -> bytes:
    """`body` without its `\\\\` pairs and then its `\\"`: only the quotes that open or close strings remain."""
    return body.replace(b"\\\\", b"").replace(b'\\"', b"")


def _commas_in_strings(flat: bytes) -> int:
    return b"".join(flat.split(b'"')[1::2]).count(b",")


class CompletionBodyGate:
    """ASGI middleware: reads a POST `/v1/completions` body whole (the body limit outside it bounds its size),
    refuses it with a 400 naming `prompt` when `body_problem` says so, else hands it on to the app unchanged."""

    def __init__(self, app: ASGIApp, max_seq_len: int, path: str = "/v1/completions"):
        self.app, self.max_seq_len, self.path = app, max_seq_len, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        try:
            body, ended = await read_body(receive)
        except Exception as e:  # the body limit's 413: raised again where the app's error handlers answer it
            await self.app(scope, raising(e), send)
            return
        if ended is None:
            problem = body_problem(body, self.max_seq_len)
            if problem is not None:
                await _error_response(400, problem, "prompt")(scope, receive, send)
                return
        await self.app(scope, replay(body, ended, receive), send)
