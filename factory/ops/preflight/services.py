"""Service checks: the lake commits and reads back, MLflow opens, the sandbox pool contains hostile code. (The rollout
server's check, which builds a model, is rollout_server.py.)"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from factory.envs.redteam import CASES, Harness, run_case, run_suite
from factory.envs.sandbox import IsolationUnavailable, SandboxLimits, SandboxPool
from factory.home import FactoryPaths
from factory.ops.preflight.result import CheckResult

if TYPE_CHECKING:
    from factory.lake.writer import Lake

QUICK_SANDBOX_CASE = "fork bomb"


def lake_commit_check(lake: Callable[[], Lake], node: str, recorded_at: dt.datetime, preflight_id: str,
                      mode: str) -> CheckResult:
    """Commit this check's own `node_health` row (as failed, "in progress") and read it back. The preflight's record
    later replaces it with the real result under the same key, so the round trip leaves nothing behind, and a
    preflight killed after it leaves a failed row that keeps the gate shut until a preflight completes."""
    # a probe imports what it probes, so a failing import fails this check only
    from pyiceberg.expressions import And, EqualTo  # noqa: PLC0415 heavy: pyiceberg (~0.5 s); the probe's own

    try:
        lk = lake()
    except Exception as e:  # noqa: BLE001 - any way the lake fails to open is this check's finding
        return CheckResult("lake_commit", False, message=f"cannot open the lake: {type(e).__name__}: {e}")
    row = {"node": node, "check": "lake_commit", "passed": False, "recorded_at": recorded_at,
           "preflight_id": preflight_id, "mode": mode,
           "message": "commit round trip in progress (a preflight that stopped here did not finish)"}
    t0 = time.perf_counter()
    try:
        lk.upsert("node_health", [row])
    except Exception as e:  # noqa: BLE001
        return CheckResult("lake_commit", False, message=f"cannot commit to the lake table node_health: "
                           f"{type(e).__name__}: {e}")
    back = lk.read("node_health", And(And(EqualTo("node", node), EqualTo("check", "lake_commit")),
                                      EqualTo("preflight_id", preflight_id)))
    seconds = time.perf_counter() - t0
    if back.num_rows != 1:
        return CheckResult("lake_commit", False, seconds, None, "s", "the committed row reads back",
                           f"committed one node_health row but read back {back.num_rows}")
    return CheckResult("lake_commit", True, round(seconds, 3), None, "s", "the committed row reads back",
                       f"committed and read back a node_health row in {seconds:.2f} s")


def mlflow_check(paths: FactoryPaths) -> CheckResult:
    # a probe imports what it probes, so a failing import fails this check only
    from factory.cockpit.tracking import Tracker  # noqa: PLC0415 heavy: mlflow (seconds); the probe's own

    tracker = Tracker(paths)
    n = len(tracker.client.search_experiments(max_results=1000))
    return CheckResult("mlflow", True, float(n), None, "experiments", "the tracking store opens and lists",
                       f"{tracker.tracking_uri} opened, {n} experiments listed")


def sandbox_check(mode: str) -> CheckResult:
    """Quick: a pool of one bwrap worker contains a fork bomb (short limits). Deep: the whole red-team suite
    (`python -m factory.envs.redteam`)."""

    expected = "pool starts; attacks contained"
    if mode == "deep":
        try:
            outcomes, metrics = run_suite(isolation="bwrap", size=2)
        except IsolationUnavailable as e:
            return CheckResult("sandbox", False, None, None, "cases", expected, f"the sandbox pool cannot isolate: {e}")
    else:
        # The fork bomb only has to meet RLIMIT_NPROC and the wall timeout: 1 s instead of the suite's 4.
        case = dataclasses.replace(next(c for c in CASES if c.name == QUICK_SANDBOX_CASE),
                                   limits=SandboxLimits(cpu_s=1.0, wall_s=1.0))
        try:
            pool = SandboxPool(size=1, isolation="bwrap", limits=case.limits)
        except IsolationUnavailable as e:
            return CheckResult("sandbox", False, None, None, "cases", expected, f"the sandbox pool cannot isolate: {e}")
        with pool, Harness() as h:
            outcomes, metrics = [run_case(pool, case, h)], pool.metrics()
    ran = [o for o in outcomes if o.contained is not None]
    escaped = [o for o in ran if not o.contained]
    value = float(len(ran) - len(escaped))
    where = f"bwrap, memory limit {metrics['memory_limit']}"
    if escaped:
        return CheckResult("sandbox", False, value, float(len(ran)), "cases", expected,
                           f"{len(escaped)} of {len(ran)} attacks NOT contained ({where}): "
                           + "; ".join(f"{o.case}: {o.reason}" for o in escaped))
    skipped = len(outcomes) - len(ran)
    names = " | ".join(o.case for o in ran[:3]) + (" | ..." if len(ran) > 3 else "")
    return CheckResult("sandbox", True, value, float(len(ran)), "cases", expected,
                       f"{len(ran)} attacks contained ({names}; {where})"
                       + (f", {skipped} skipped here" if skipped else ""))
