"""Preflight node tests, run again and again on one healthy node: how long each takes, and whether any check ever
raises a false alarm; with the margin between the lowest value each throughput check measured and its floor.

Each run is `factory preflight --json` in a fresh process, as a Dagster run worker or a new shell would run it
(imports included), all in one FACTORY_HOME (the first run also sets up the lake tables and the MLflow store).

    .venv/bin/python benchmarks/preflight.py                 # 20 quick runs, ~4 min on 2 cores
    .venv/bin/python benchmarks/preflight.py --runs 3 --deep # deep mode, ~1 min each

Prints a table (one row per run: seconds, failed checks, matmul, memory, disk), then one JSON line: runs, mode,
false_alarms, seconds_min/median/max, and per throughput check its floor, min and median value and min/floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WATCHED = ("matmul", "memory_bandwidth", "disk_write_checkpoints", "disk_read_checkpoints", "disk_write_lake",
           "disk_read_lake", "allreduce", "lake_commit", "rollout_server")


def one_run(home: str, deep: bool) -> tuple[float, dict]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "factory.cli", "--home", home, "preflight", "--json",
                        *(["--deep"] if deep else [])], capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if not p.stdout.strip():
        raise SystemExit(f"factory preflight printed nothing (exit {p.returncode}): {p.stderr[-2000:]}")
    return seconds, json.loads(p.stdout.strip().splitlines()[-1])


def _value(checks: dict, name: str) -> str:
    x = checks.get(name, {}).get("value")
    return "-" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--deep", action="store_true")
    ap.add_argument("--home", help="FACTORY_HOME to use (default: a fresh temp directory)")
    args = ap.parse_args(argv)
    home = args.home or tempfile.mkdtemp(prefix="preflight-bench-")
    print(f"{'run':>3}  {'seconds':>7}  {'result':<6}  {'matmul':>8}  {'memory':>7}  {'disk w':>7}  {'disk r':>7}  "
          f"failed")
    seconds, values, floors, alarms = [], {c: [] for c in WATCHED}, {}, []
    for i in range(1, args.runs + 1):
        s, report = one_run(home, args.deep)
        seconds.append(s)
        checks = {c["name"]: c for c in report["checks"]}
        for name in WATCHED:
            if name in checks and checks[name]["value"] is not None:
                values[name].append(checks[name]["value"])
                # Only floors (">= ..."): the rollout server's threshold is a ceiling on its start-up seconds.
                floors[name] = checks[name]["threshold"] if checks[name]["expected"].startswith(">=") else None
        failed = [f"{c['name']} ({c['message']})" for c in report["checks"] if not c["passed"]]
        alarms += failed
        shown = [_value(checks, n) for n in ("matmul", "memory_bandwidth", "disk_write_checkpoints",
                                             "disk_read_checkpoints")]
        print(f"{i:>3}  {s:7.1f}  {'ok' if report['passed'] else 'FAIL':<6}  {shown[0]:>8}  {shown[1]:>7}  "
              f"{shown[2]:>7}  {shown[3]:>7}  {'; '.join(failed)}", flush=True)
    margins = {}
    for name, xs in values.items():
        if not xs:
            continue
        floor = floors.get(name)
        margins[name] = {"floor": floor, "min": round(min(xs), 3), "median": round(statistics.median(xs), 3),
                         "min_over_floor": round(min(xs) / floor, 2) if floor else None}
    print(json.dumps({"runs": args.runs, "mode": "deep" if args.deep else "quick", "kind": report["kind"],
                      "false_alarms": len(alarms), "alarms": alarms[:10],
                      "seconds_min": round(min(seconds), 2), "seconds_median": round(statistics.median(seconds), 2),
                      "seconds_max": round(max(seconds), 2), "checks": margins}))
    return 0 if not alarms else 1


if __name__ == "__main__":
    sys.exit(main())
