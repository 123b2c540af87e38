"""The preflight gate: training starts only on a node whose latest preflight passed.

For each check, the node's latest result younger than `ops.preflight_max_age_s` counts; any failed one refuses the
run with `PreflightFailed`, naming the checks and when they ran. When the node has no result that young, a quick
preflight runs first (one at a time per FACTORY_HOME: a second caller waits for it and uses its results instead of
measuring throughput beside it). A partial re-run (`factory preflight --check matmul`) after a fix replaces just that
check's result. `ops.preflight: off` or FACTORY_PREFLIGHT=off skips the gate.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from factory.home import FactoryPaths
from factory.ops.preflight.nodes import node_name
from factory.ops.preflight.result import _num
from factory.ops.preflight.runner import run_preflight
from factory.progress import Log

if TYPE_CHECKING:
    from factory.config import OpsSpec
    from factory.lake.writer import Lake

_log = logging.getLogger(__name__)
LOCK_FILE = ".preflight.lock"


@dataclass(frozen=True)
class FailedCheck:
    check: str
    value: float | None
    threshold: float | None
    unit: str
    message: str
    at: dt.datetime
    preflight_id: str


class PreflightFailed(RuntimeError):
    """The node's latest preflight failed: `checks` names the failed checks; the message says when and why."""

    def __init__(self, node: str, failed: list[FailedCheck]):
        self.node, self.failed = node, failed
        self.checks = [f.check for f in failed]
        lines = [f"{f.check} (at {f.at:%Y-%m-%d %H:%M:%S} UTC, preflight {f.preflight_id}): value {_num(f.value)}, "
                 f"threshold {_num(f.threshold)}{' ' + f.unit if f.unit else ''}: {f.message}" for f in failed]
        super().__init__(
            f"node {node} failed preflight check(s) {', '.join(self.checks)}; training refused.\n  "
            + "\n  ".join(lines)
            + f"\nFix the node, then run `factory preflight` (or only these: `factory preflight "
              f"{' '.join('--check ' + c for c in self.checks)}`); ops.preflight: off or FACTORY_PREFLIGHT=off "
              f"skips the gate.")


def preflight_disabled(ops: OpsSpec) -> str:
    """Why the gate is off ('' when it is on)."""
    if os.environ.get("FACTORY_PREFLIGHT", "").strip().lower() == "off":
        return "FACTORY_PREFLIGHT=off"
    if ops.preflight == "off":
        return "ops.preflight: off"
    return ""


def latest_results(lake: Lake, node: str, since: dt.datetime) -> dict[str, dict[str, Any]]:
    """{check: its latest `node_health` row} for `node`, among rows recorded at or after `since`."""
    from pyiceberg.expressions import And, EqualTo, GreaterThanOrEqual  # noqa: PLC0415 heavy: pyiceberg; reading only

    micros = int(since.timestamp() * 1_000_000)
    rows = lake.read("node_health", And(EqualTo("node", node), GreaterThanOrEqual("recorded_at", micros))).to_pylist()
    latest: dict[str, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: r["recorded_at"]):
        latest[r["check"]] = r
    return latest


def gate(ops: OpsSpec, paths: FactoryPaths, lake: Lake | None = None,
         log: Log = _log.info) -> None:
    """Return if this node may train; raise PreflightFailed if its latest preflight failed. Runs a quick preflight
    first when the node has none younger than ops.preflight_max_age_s. See the module docstring."""
    why = preflight_disabled(ops)
    if why:
        log(f"preflight gate off ({why})")
        return
    node = node_name()
    opened = None
    if lake is None:
        from factory.lake.writer import Lake  # noqa: PLC0415 heavy: pyiceberg, duckdb; when the gate reads the lake

        try:
            lake = opened = Lake.open(paths)
        except Exception as e:  # noqa: BLE001 - a lake that cannot open is for the preflight to report
            log(f"preflight gate: cannot open the lake ({type(e).__name__}: {e})")
    try:
        latest = _fresh(lake, node, ops.preflight_max_age_s, log)
        if not latest:
            with _one_at_a_time(paths):
                latest = _fresh(lake, node, ops.preflight_max_age_s, log)  # another caller may have just run one
                if not latest:
                    latest = _run_now(paths, lake, node, ops.preflight_max_age_s, log)
    finally:
        if opened is not None:
            opened.close()
    failed = [FailedCheck(r["check"], r["value"], r["threshold"], r["unit"] or "", r["message"] or "",
                          _utc(r["recorded_at"]), r["preflight_id"] or "?")
              for r in sorted(latest.values(), key=lambda r: r["check"]) if not r["passed"]]
    if failed:
        raise PreflightFailed(node, failed)
    newest = max(_utc(r["recorded_at"]) for r in latest.values())
    log(f"preflight gate: node {node} passed its latest checks ({len(latest)} checks, newest at "
        f"{newest:%Y-%m-%d %H:%M:%S} UTC)")


def _fresh(lake: Lake | None, node: str, max_age_s: float, log: Log) -> dict[str, dict[str, Any]]:
    if lake is None:
        return {}
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=max_age_s)
    try:
        return latest_results(lake, node, since)
    except Exception as e:  # noqa: BLE001 - unreadable history: measure now instead
        log(f"preflight gate: cannot read node_health ({type(e).__name__}: {e})")
        return {}


def _run_now(paths: FactoryPaths, lake: Lake | None, node: str, max_age_s: float,
             log: Log) -> dict[str, dict[str, Any]]:
    log(f"preflight gate: no preflight of node {node} in the last {max_age_s:g} s; running a quick one")
    report = run_preflight(paths, lake, mode="quick", log=log)
    log(f"preflight gate: quick preflight {report.preflight_id} {'passed' if report.passed else 'FAILED'} in "
        f"{report.seconds:.1f} s" + ("" if report.recorded else f" (not recorded: {report.record_error})"))
    return {r["check"]: r for r in report.rows()}


@contextlib.contextmanager
def _one_at_a_time(paths: FactoryPaths) -> Iterator[None]:
    """An exclusive lock per FACTORY_HOME (flock: released if the holder dies). Without a writable home there is
    no lock, and callers may measure side by side."""
    try:
        fd = os.open(paths.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _utc(t: dt.datetime) -> dt.datetime:
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t.astimezone(dt.UTC)
