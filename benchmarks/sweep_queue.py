"""A sweep through the real Dagster stack: how fast its runs start, how closely they follow each other, and
that the concurrency limit holds.

Starts the cockpit (`dagster dev` and the MLflow UI, factory/ops/cockpit.py) on 127.0.0.1 with a temp
FACTORY_HOME, launches the `sweep` job through the webserver's GraphQL API (the launchpad's own mutation)
with --members tiny members sharing one SFT warm start and --max-concurrent, and polls the run storage
every 0.25 s until every member has succeeded:

- first start: from the launch request until the sweep's first run (its warm start) is started;
- hand-off: from a member run's end to the start of the next one the launcher sensor starts (mean, max);
- concurrency: the most runs of the sweep (warm start + members) seen in flight at once (never above the
  limit), and that the warm start was trained once, before any member started;
- a bad axis launched the same way fails, and no run of it appears.

    .venv/bin/python benchmarks/sweep_queue.py                 # 16 members, 2 at a time
    .venv/bin/python benchmarks/sweep_queue.py --members 4     # quicker

Prints a table, then one JSON line: first_start_s, handoff_mean_s, handoff_max_s, members, max_concurrent,
max_in_flight_seen, warm_start_runs, warm_start_before_members, bad_axis_rejected, all_done_s, wall_s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from factory.ops.cockpit import cockpit  # noqa: E402

TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=2", "schedule.eval_pass_k=2"]
LAUNCH = """mutation($p: ExecutionParams!) { launchPipelineExecution(executionParams: $p) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } } }"""
RUNS = """query($job: String!) { runsOrError(filter: {pipelineName: $job}) {
  ... on Runs { results { runId status startTime endTime tags { key value } } } } }"""
IN_FLIGHT = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING")


def gql(url: str, query: str, variables: dict) -> dict:
    r = httpx.post(f"{url}/graphql", json={"query": query, "variables": variables}, timeout=60)
    r.raise_for_status()
    body = r.json()
    if "errors" in body:
        raise RuntimeError(body["errors"])
    return body["data"]


def launch(url: str, config: dict) -> str:
    params = {"selector": {"repositoryLocationName": "factory", "repositoryName": "__repository__",
                           "pipelineName": "sweep"},
              "runConfigData": {"ops": {"plan_and_queue_sweep": {"config": config}}}, "mode": "default"}
    out = gql(url, LAUNCH, {"p": params})["launchPipelineExecution"]
    if out["__typename"] != "LaunchRunSuccess":
        raise RuntimeError(f"launch failed: {out}")
    return out["run"]["runId"]


def runs(url: str, job: str) -> list[dict]:
    return gql(url, RUNS, {"job": job})["runsOrError"]["results"]


def wait(cond, timeout: float, what: str, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)  # polling the server, bounded by the deadline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument("--max-concurrent", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for every member")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="sweep-queue-"))
    with cockpit(tmp / "factory-home") as (ui, _mlflow):
        url = ui.url
        base = {"name": "bench", "base_spec": str(ROOT / "examples" / "quickstart.yaml"), "overrides": TINY}

        # A bad axis: the sweep run fails and nothing is launched.
        launch(url, {**base, "axes": {"algorithm.lrr": [1e-5, 3e-5]}})
        bad = wait(lambda: [r for r in runs(url, "sweep") if r["status"] in ("FAILURE", "SUCCESS")], 120,
                   "bad sweep ended")
        bad_rejected = bad[0]["status"] == "FAILURE" and not runs(url, "sweep_member_job")

        # Members differ in RL settings only (lr), so they share one warm start.
        lrs = [round(1e-4 * (1 + i), 6) for i in range(args.members)]
        t0 = time.time()
        launch(url, {**base, "axes": {"algorithm.lr": lrs}, "max_concurrent": args.max_concurrent})
        max_in_flight = 0

        def sweep_runs() -> list[dict]:
            return runs(url, "sweep_warm_start_job") + runs(url, "sweep_member_job")

        def all_done() -> list[dict] | None:
            nonlocal max_in_flight
            rs = sweep_runs()
            max_in_flight = max(max_in_flight, sum(r["status"] in IN_FLIGHT for r in rs))
            failed = [r for r in rs if r["status"] in ("FAILURE", "CANCELED")]
            if failed:
                raise RuntimeError(f"runs failed: {failed}")
            members = [r for r in rs if r["tags"] and any(t["key"] == "factory/member" for t in r["tags"])]
            done = len(members) == args.members and all(r["status"] == "SUCCESS" for r in rs)
            return rs if done else None

        rs = wait(all_done, args.timeout, "all members succeeded")
        all_done_s = time.time() - t0

    ordered = sorted(rs, key=lambda r: r["startTime"])
    warm = [r for r in rs if any(t["key"] == "factory/warm_start" for t in r["tags"])]
    first_start_s = ordered[0]["startTime"] - t0
    # A hand-off: a run ends, freeing a slot, and the launcher starts the next one (sensor tick + run start).
    gaps = []
    for r in ordered[1:]:
        earlier = [e["endTime"] for e in ordered if e["endTime"] and e["endTime"] <= r["startTime"]]
        if earlier:
            gaps.append(r["startTime"] - max(earlier))
    warm_first = len(warm) == 1 and all(warm[0]["endTime"] <= r["startTime"] for r in rs if r is not warm[0])
    print()
    print(f"{'members':>8} {'limit':>6} {'first start':>12} {'hand-off mean/max':>18} {'max in flight':>14} "
          f"{'warm starts':>12} {'all done in':>12} {'bad axis':>9}")
    print(f"{args.members:>8} {args.max_concurrent:>6} {first_start_s:>11.1f}s "
          f"{sum(gaps) / max(1, len(gaps)):>9.1f}s/{max(gaps, default=0):>5.1f}s {max_in_flight:>14} "
          f"{len(warm):>12} {all_done_s:>11.0f}s {'rejected' if bad_rejected else 'LAUNCHED':>9}")
    mean_gap = sum(gaps) / max(1, len(gaps))
    print(json.dumps({"first_start_s": round(first_start_s, 2), "handoff_mean_s": round(mean_gap, 2),
                      "handoff_max_s": round(max(gaps, default=0.0), 2), "members": args.members,
                      "max_concurrent": args.max_concurrent, "max_in_flight_seen": max_in_flight,
                      "warm_start_runs": len(warm), "warm_start_before_members": warm_first,
                      "bad_axis_rejected": bad_rejected, "all_done_s": round(all_done_s, 1),
                      "wall_s": round(time.perf_counter() - t_start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
