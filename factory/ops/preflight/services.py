"""Service checks: the lake commits and reads back, MLflow opens, the sandbox pool contains hostile code, and the
rollout server starts on a fresh checkpoint and serves a completion."""

from __future__ import annotations

import dataclasses
import datetime as dt
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from factory.home import FactoryPaths
from factory.ops.preflight.result import CheckResult

if TYPE_CHECKING:
    from factory.lake.writer import Lake

ROLLOUT_STARTUP_S = 90.0
QUICK_SANDBOX_CASE = "fork bomb"


def lake_commit_check(lake: Callable[[], Lake], node: str, recorded_at: dt.datetime, preflight_id: str,
                      mode: str) -> CheckResult:
    """Commit this check's own `node_health` row (as failed, "in progress") and read it back. The preflight's record
    later replaces it with the real result under the same key, so the round trip leaves nothing behind, and a
    preflight killed after it leaves a failed row that keeps the gate shut until a preflight completes."""
    # heavy: pyiceberg; a probe imports what it probes, so a failing import fails this check only
    from pyiceberg.expressions import And, EqualTo

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
    # heavy: mlflow; a probe imports what it probes, so a failing import fails this check only
    from factory.cockpit.tracking import Tracker

    tracker = Tracker(paths)
    n = len(tracker.client.search_experiments(max_results=1000))
    return CheckResult("mlflow", True, float(n), None, "experiments", "the tracking store opens and lists",
                       f"{tracker.tracking_uri} opened, {n} experiments listed")


def sandbox_check(mode: str) -> CheckResult:
    """Quick: a pool of one bwrap worker contains a fork bomb (short limits). Deep: the whole red-team suite
    (`python -m factory.envs.redteam`)."""
    # probe: the sandbox is imported by its check, so a failing import fails this check, not the whole preflight
    from factory.envs.redteam import CASES, Harness, run_case, run_suite
    from factory.envs.sandbox import IsolationUnavailable, SandboxLimits, SandboxPool

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


def rollout_server_check(paths: FactoryPaths) -> CheckResult:
    """`factory serve` on a freshly built `micro` checkpoint, supervised, answers POST /v1/completions."""
    # heavy: torch, transformers; a probe imports what it probes, so a failing import fails this check only
    import httpx

    from factory.infra.supervisor import ServiceProcess, ServiceUnavailable
    from factory.models.build import build_model
    from factory.models.checkpoint import save_checkpoint
    from factory.models.tokenizer import build_tokenizer

    expected = f"serves a completion within {ROLLOUT_STARTUP_S:.0f} s"
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".preflight-serve-", dir=paths.checkpoints))
    try:
        tok = build_tokenizer()
        save_checkpoint(build_model("micro", tok, seed=0), tok, tmp / "micro")
        argv = [sys.executable, "-m", "factory.cli", "serve", "--checkpoint", str(tmp / "micro"), "--port", "{port}",
                "--threads", "1", "--max-batch", "4"]
        try:
            with ServiceProcess("preflight rollout server", argv, log_path=tmp / "serve.log",
                                startup_timeout=ROLLOUT_STARTUP_S, max_restarts=0) as svc:
                r = httpx.post(f"{svc.url}/v1/completions", timeout=30.0,
                               json={"model": "micro", "prompt": "12+34=", "max_tokens": 4, "temperature": 0})
        except ServiceUnavailable as e:
            log = (tmp / "serve.log").read_text(errors="replace").strip().splitlines()[-3:]
            return CheckResult("rollout_server", False, None, ROLLOUT_STARTUP_S, "s", expected,
                               f"{e}; last log lines: {' | '.join(log)}")
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            return CheckResult("rollout_server", False, seconds, ROLLOUT_STARTUP_S, "s", expected,
                               f"POST /v1/completions answered {r.status_code}: {r.text[:200]}")
        choice = r.json()["choices"][0]
        if not choice.get("token_ids"):
            return CheckResult("rollout_server", False, seconds, ROLLOUT_STARTUP_S, "s", expected,
                               f"POST /v1/completions returned no tokens: {choice}")
        return CheckResult("rollout_server", True, round(seconds, 2), ROLLOUT_STARTUP_S, "s", expected,
                           f"started `factory serve` on a fresh micro checkpoint and got a completion of "
                           f"{len(choice['token_ids'])} tokens in {seconds:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
