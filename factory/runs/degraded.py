"""How a run meets a degraded dependency: the lake down (spooled writes, a budget, a stop at a resume point) and
a full disk (a named directory, its own exit code). The pieces `rl_run` calls, kept here so the run's own
module stays about training."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from factory.infra.disk import DiskFull, full_disk_dir, is_disk_full
from factory.infra.faults import fault_point
from factory.lake.spool import LakeDown, SpooledLake, down_message, is_catalog_error, is_outage
from factory.runs.exit_codes import EXIT_DEPENDENCY_DOWN, EXIT_DISK_FULL

T = TypeVar("T")


def watch_lake(lake: SpooledLake, budget_s: float) -> str | None:
    """During an outage, try the lake again (at most every `probe_every_s`); once it has lasted past `budget_s`, the
    one-line cause of the stop. None while the lake answers or the outage is within the budget."""
    spool = lake.spool
    if spool.down_since is None or lake.try_flush():
        return None
    return down_message(spool, budget_s) if spool.outage_s() > budget_s else None


def unless_down(read: Callable[[], T], fallback: T) -> T:
    """`read()` from the lake, or `fallback` while the lake is down."""
    try:
        return read()
    except Exception as e:
        if not is_outage(e):
            raise
        return fallback


def tolerating(record: Callable[[], None], log: Callable[[str], None], what: str) -> None:
    """`record()`, which may itself meet the lake down or the disk full: then say so and go on (the stop stays
    clean: the spool and the resume point keep what matters)."""
    try:
        record()
    except Exception as e:
        if not (is_disk_full(e) or is_outage(e)):
            raise
        log(f"could not record {what}: {e}")


@contextlib.contextmanager
def disk_guard(point: str, where: Path) -> Iterator[None]:
    """A write into `where`: a full disk there (in any library's clothes, e.g. safetensors') becomes DiskFull
    naming the directory. `point` is the fault point a test strikes with FACTORY_FAULT_ENOSPC."""
    try:
        fault_point(point, where)
        yield
    except Exception as e:
        if is_disk_full(e) and not isinstance(e, DiskFull):
            raise DiskFull(where.parent, e) from e
        raise


def stop_code(e: BaseException, home: Path, run_id: str) -> int | None:
    """The exit code of an attempt that ended with `e` when that is a degraded dependency (one line said on
    stderr), else None: the lake down past its budget, a full disk, the catalog unreachable at the start."""
    if isinstance(e, LakeDown):
        print(f"factory: error: run {run_id} stopped: {e}", file=sys.stderr)
        return EXIT_DEPENDENCY_DOWN
    if (full := full_disk_dir(e, default=home)) is not None:
        print(f"factory: error: run {run_id} stopped: disk full: {full} (free space, then: factory resume {run_id})",
              file=sys.stderr)
        return EXIT_DISK_FULL
    if is_catalog_error(e):
        print(f"factory: error: run {run_id} stopped: lake unavailable: {type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return EXIT_DEPENDENCY_DOWN
    return None
