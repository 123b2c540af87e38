"""What a caller may ask of the sandbox pool and what it gets back: `SandboxLimits` (bounded), `ExecResult`, and
the checks on a request (code, stdin, files) that refuse the caller's mistakes before anything runs.

A refused request raises `SandboxRequestError` (a ValueError) naming the part at fault; nothing is run and no
worker is touched. What the code itself does is never an error here: it is an `ExecResult` with ok=False.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from factory.text import clip

# Upper bounds of each limit. Past them the kernel or the worker would fail in ways that are not the code's doing
# (an rlimit or select() timeout that overflows, a reply over the worker's 256 MiB frame: two streams of
# output_bytes, each byte up to 6 once JSON-escaped), so a request for more is refused up front.
LIMIT_MAX: dict[str, float] = {"cpu_s": 3600.0, "wall_s": 3600.0, "memory_mb": 1 << 20, "processes": 1 << 16,
                               "file_size_mb": 1 << 20, "open_files": 1 << 16, "output_bytes": 16 << 20}

MAX_NAME_BYTES = 1024  # a file name (path) in `files`; a component is at most 255 bytes, as on Linux
_RESERVED = "main.py"  # the code is written there unless `files` gives one


class SandboxRequestError(ValueError):
    """A request the pool refuses (the caller's mistake); `field` names the part at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SandboxLimits:
    """Per-execution limits. cpu_s: RLIMIT_CPU (SIGXCPU); wall_s: the worker kills the code's processes;
    memory_mb: RLIMIT_AS per process (and the worker's cgroup where available); processes: RLIMIT_NPROC;
    file_size_mb: RLIMIT_FSIZE; open_files: RLIMIT_NOFILE; output_bytes: cap on stdout and on stderr.
    Each must be a finite number in (0, LIMIT_MAX[name]]."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    processes: int = 64
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not (ok and 0 < v <= LIMIT_MAX[f.name]):
                raise ValueError(f"SandboxLimits.{f.name} must be a number in (0, {LIMIT_MAX[f.name]:g}], "
                                 f"got {v!r}")


@dataclass
class ExecResult:
    """What one execution did. ok: exit 0, no timeout, not killed, output not truncated."""

    ok: bool
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None  # signal name, e.g. "SIGKILL", "SIGXCPU"
    truncated: bool  # stdout or stderr went over output_bytes (the code was then killed)
    reason: str  # "" when ok, else a short human reason
    wall_s: float
    # What the execution left behind, by kind (count; sysv_shm_bytes, memory_mb), all of it removed or its worker
    # replaced before the next execution: see sandbox_confine.leftovers and SandboxPool.metrics.
    leftovers: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecResult:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d or f.name != "leftovers"})


def _check_request(code: str, stdin: str, files: dict[str, str] | None) -> None:
    """Raise SandboxRequestError for what the worker could not set up: text that is not Unicode, and file names
    that are not plain relative paths inside the run directory or that collide (one is another's directory)."""
    _check_text("code", code)
    _check_text("stdin", stdin)
    if files is None:
        return
    if not isinstance(files, dict):
        raise SandboxRequestError("files", f"want a mapping of file names to their text, got {type(files).__name__}")
    for name, text in files.items():
        _check_name(name)
        _check_text(f"files[{_show(name)}]", text)
    for name in files:
        parts = name.split("/")
        for k in range(1, len(parts)):
            parent = "/".join(parts[:k])
            if parent in files or parent == _RESERVED:
                what = "the code's file" if parent == _RESERVED and parent not in files else "a file"
                raise SandboxRequestError("files", f"bad file name {_show(name)}: it needs {parent!r} to be a "
                                                   f"directory, but that is {what}")


def _check_name(name: object) -> None:
    why = None
    if not isinstance(name, str) or not name:
        why = "not a non-empty string"
    elif "\0" in name:
        why = "it holds a NUL character"
    elif name.startswith("/"):
        why = "it is absolute"
    elif not _encodes(name):
        why = "it is not valid Unicode text"
    elif len(name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
        why = f"it is over {MAX_NAME_BYTES} bytes"
    else:
        for part in name.split("/"):
            if part in ("", ".", ".."):
                why = "it has an empty, '.' or '..' component (or ends with '/')"
                break
            if len(part.encode("utf-8", "surrogateescape")) > 255:
                why = "a component is over 255 bytes"
                break
    if why is not None:
        raise SandboxRequestError("files", f"bad file name {_show(name)}: {why} (want a relative path inside the "
                                           f"run directory, like 'data/input.txt', mapped to its text)")


def _check_text(field: str, text: object) -> None:
    if not isinstance(text, str):
        raise SandboxRequestError(field, f"want text, got {type(text).__name__}")
    try:
        text.encode("utf-8", "surrogateescape")  # what the worker writes; surrogateescape keeps raw bytes
    except UnicodeEncodeError as e:
        raise SandboxRequestError(field, f"not valid Unicode text (a lone surrogate at character {e.start})") from None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def _show(value: object) -> str:
    """repr(value), at most 100 characters: a huge name is never echoed whole."""
    return clip(repr(value))
