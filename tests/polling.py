"""Bounded polling for tests that watch other processes: the limit exists only so a broken run cannot hang CI."""

from __future__ import annotations

import os
import select
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, ready: Callable[[], T], limit_s: float = 300.0, every_s: float = 0.05) -> T:
    """Poll `ready()` until it returns something truthy, and return that; AssertionError naming `what` after
    `limit_s` seconds."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def process_gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie waiting to be)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def exits_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` has exited or exits within `timeout_s`: its pidfd turns readable when it does (no
    polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)
