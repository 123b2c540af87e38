"""A full disk, told apart from other failures: `DiskFull` (raised where a write names its directory) and
`full_disk_dir`, which finds a full disk anywhere in an exception's chain, so a run stops with "disk full: DIR"
(its own exit code, no restart spent) instead of a traceback that the restart supervisor counts as a crash.

Libraries report a full disk in different clothes: an OSError with errno ENOSPC (or EDQUOT, a quota), a
safetensors `SafetensorError` whose text carries the Rust io error ("No space left on device", os error 28),
SQLite's "database or disk is full"; all are recognised.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How the errors that carry no errno say it (safetensors' Rust io::Error, SQLite, pyarrow).
FULL_TEXTS = ("no space left on device", "os error 28", "storagefull", "database or disk is full",
              "disk quota exceeded")


class DiskFull(OSError):
    """A write into `dir` failed because its filesystem is full."""

    def __init__(self, dir: Path | str, cause: BaseException | None = None):
        super().__init__(errno.ENOSPC, f"disk full: {dir}")
        self.dir = Path(dir)
        self.cause = cause

    def __str__(self) -> str:
        return f"disk full: {self.dir}"


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen and len(seen) < 32:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` (or an exception it was raised from) is a full disk."""
    for x in _chain(e):
        if isinstance(x, DiskFull):
            return True
        if isinstance(x, OSError) and x.errno in FULL_ERRNOS:
            return True
        if any(t in str(x).lower() for t in FULL_TEXTS):
            return True
    return False


def full_disk_dir(e: BaseException, default: Path | str | None = None) -> Path | None:
    """The directory whose disk is full according to `e`'s chain: a `DiskFull`'s, else the directory of the
    file an ENOSPC OSError names, else `default`. None when `e` is not a full disk at all."""
    if not is_disk_full(e):
        return None
    for x in _chain(e):
        if isinstance(x, DiskFull):
            return x.dir
    for x in _chain(e):
        if isinstance(x, OSError) and x.filename:
            p = Path(os.fsdecode(x.filename))
            return p if p.is_dir() else p.parent
    return Path(default) if default is not None else Path.cwd()
