"""Spec errors: `SpecError` (one `path: problem` line per error) and how pydantic's errors are worded as such lines,
with any echoed input clipped."""

from __future__ import annotations

from typing import Any

from factory.text import clip


class SpecError(ValueError):
    """A spec that cannot be used; `str()` lists one `path: problem` line per error."""

    def __init__(self, errors: list[str], source: str | None = None):
        self.errors = errors
        self.source = source
        head = f"invalid spec {source}" if source else "invalid spec"
        super().__init__(head + ":\n" + "\n".join(f"  {e}" for e in errors))


_ECHO_CHARS = 100  # longest input echoed whole in an error; longer ones are clipped
_MESSAGE_CHARS = 600


def _clip(value: Any) -> str:
    """repr(value), clipped: an error must not echo a 10 MB field back."""
    return clip(repr(value), _ECHO_CHARS, mark="…", unit="chars", size=len(value) if isinstance(value, str) else None)


def _describe(err: dict[str, Any]) -> str:
    return _shorten(_describe_one(err))


def _shorten(line: str) -> str:
    return line if len(line) <= _MESSAGE_CHARS else f"{line[:_MESSAGE_CHARS]}… ({len(line)} chars)"


def spec_error(message: str, source: str | None = None) -> SpecError:
    """A SpecError for a check made outside the schema (`factory.envs.spec_check.check_spec`), worded as the
    schema words its own whole-spec checks."""
    return SpecError([_shorten(message)], source)


def _describe_one(err: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in err["loc"]) or "<spec>"
    kind = err["type"]
    ctx = err.get("ctx") or {}
    got = _clip(err.get("input"))
    if kind == "extra_forbidden":
        return f"{loc}: unknown key (not a field of this section)"
    if kind == "missing":
        return f"{loc}: required field is missing"
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        op, key = bounds[kind]
        return f"{loc}: must be {op} {ctx.get(key)}, got {got}"
    if kind == "finite_number":
        return f"{loc}: must be a finite number, got {got}"
    if kind == "literal_error":
        return f"{loc}: expected {ctx.get('expected')}, got {got}"
    if kind == "value_error":
        # Our own validators: the message already says what was expected.
        msg = str(ctx.get("error", err["msg"]))
        if loc.startswith("<spec>") or loc == "" or msg.startswith(f"{loc}."):  # a section's check names its field
            return msg
        return f"{loc}: {msg}"
    # pydantic's own message, as written (lowercasing it mangled patterns and names).
    return f"{loc}: {err['msg']}, got {got}"
