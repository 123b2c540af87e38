"""Shortening text of unbounded size (a request's field, an exception's message, a spec's value) before an error
message, a log line, a reason or a table cell quotes it: one `clip` for all of them; and a PNG as a markdown image."""

from __future__ import annotations

import base64

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def clip(value: object, limit: int = 100, *, mark: str = "...", unit: str | None = "characters",
         size: int | None = None) -> str:
    """`value` (a str as is, anything else its repr) whole when it has at most `limit` characters; else shortened.

    With a `unit` (to quote a value in an error): its first `limit` characters, `mark` and how long it was, as
    "<start>... (1000 characters)"; `size` replaces the length counted (e.g. the length of the str a repr shows).
    With `unit=None` (for a field with a maximum size): its start and `mark`, `limit` characters in all.
    """
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    if unit is None:
        return text[: limit - len(mark)] + mark
    return f"{text[:limit]}{mark} ({len(text) if size is None else size} {unit})"


def markdown_image(png: bytes, alt: str) -> str:
    """A markdown image with the PNG inlined as a base64 data URI (here rather than in factory/cockpit/plots.py, so
    callers that only wrap a picture drawn elsewhere do not import matplotlib)."""
    if not png.startswith(PNG_SIGNATURE):
        raise ValueError("markdown_image: the bytes are not a PNG")
    # Brackets and newlines in the alt text would end the markdown image early.
    safe_alt = " ".join(alt.replace("[", "(").replace("]", ")").split())
    return f"![{safe_alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"
