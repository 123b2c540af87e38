"""How a run meets a degraded dependency: the lake down (spooled writes, a budget, a stop at a resume point) and
a full disk (a named directory, its own exit code). The pieces `rl_run` calls, kept here so the run's own
module stays about training."""

from __future__ import annotations

import contextlib
import sys
import time
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


def when_lake_up(use: Callable[[], T], budget_s: float, *, beat: Callable[[], None], log: Callable[[str], None],
                 every_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """`use()`: an attempt's first reads of the lake. While the catalog is unreachable, try again every `every_s`
    seconds for up to `budget_s` (ops.lake_outage_s), beating the heartbeat between tries (`beat`) so the supervisor
    does not take the wait for a hang; past it, the catalog's error goes up (`stop_code` makes it the one-line stop).
    A run killed during an outage thus waits for the lake instead of stopping at once. Says so once a minute."""
    start, said = clock(), None
    while True:
        try:
            return use()
        except Exception as e:
            waited = clock() - start
            if not (is_catalog_error(e) or is_outage(e)) or waited >= budget_s:
                raise
            if said is None or waited - said >= 60.0:
                log(f"lake unavailable ({type(e).__name__}): waited {waited:.0f} s of ops.lake_outage_s = "
                    f"{budget_s:g}; trying again every {every_s:g} s")
                said = waited
        beat()
        sleep(min(every_s, max(0.0, budget_s - (clock() - start))))


def read_when_up(read: Callable[[], T], budget_s: float, log: Callable[[str], None], *,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """`read()` of what a finished run left in the lake (its row, its evals for the report), by a process that holds
    no heartbeat (`factory run`, `factory resume` after their attempts): waited out like an attempt's first reads
    (`when_lake_up`) while the catalog is unreachable, for up to `budget_s` (ops.lake_outage_s)."""
    return when_lake_up(read, budget_s, beat=lambda: None, log=log, sleep=sleep)


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
