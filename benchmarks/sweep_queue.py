"""A sweep through the real Dagster stack: time to validate and queue its members, and their concurrency.

Starts `dagster dev` on 127.0.0.1 with a temp FACTORY_HOME/DAGSTER_HOME (run queue with one run per
sweep lane, `factory.sweep.dagster_instance_yaml`), launches the `sweep` job through the webserver's
GraphQL API (the launchpad's own mutation) with --members tiny members and --max-concurrent lanes,
and polls the run storage every 0.25 s until every member has succeeded:

- queue time: from the launch request until every member run exists (queued or further);
- concurrency: the most member runs seen STARTED at once (must equal the limit, never exceed it);
- a bad axis launched the same way fails, and no member run appears.

    .venv/bin/python benchmarks/sweep_queue.py                 # 16 members, 2 at a time (~4 min here)
    .venv/bin/python benchmarks/sweep_queue.py --members 4     # quicker

Prints a table, then one JSON line: queue_s, members, max_concurrent, max_running_seen, all_succeeded,
bad_axis_rejected, wall_s.
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

from factory.ops.dagster_dev import dagster_dev  # noqa: E402

TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=2", "schedule.eval_pass_k=2"]
LAUNCH = """mutation($p: ExecutionParams!) { launchPipelineExecution(executionParams: $p) {
  __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } } }"""
RUNS = """query($job: String!) { runsOrError(filter: {pipelineName: $job}) {
  ... on Runs { results { runId status tags { key value } } } } }"""


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
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds to wait for every member")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="sweep-queue-"))
    with dagster_dev(tmp / "factory-home", max_concurrent_runs=args.max_concurrent + 2) as ui:
        url = ui.url
        base = {"name": "bench", "base_spec": str(ROOT / "examples" / "quickstart.yaml"), "overrides": TINY}

        # A bad axis: the sweep run fails and nothing is queued.
        launch(url, {**base, "axes": {"algorithm.lrr": [1e-5, 3e-5]}})
        bad = wait(lambda: [r for r in runs(url, "sweep") if r["status"] in ("FAILURE", "SUCCESS")], 120,
                   "bad sweep ended")
        bad_rejected = bad[0]["status"] == "FAILURE" and not runs(url, "sweep_member_job")

        t0 = time.perf_counter()
        launch(url, {**base, "axes": {"seed": list(range(args.members))}, "max_concurrent": args.max_concurrent})
        wait(lambda: len(runs(url, "sweep_member_job")) >= args.members, 120, "all members queued")
        queue_s = time.perf_counter() - t0
        print(f"{args.members} members validated and queued in {queue_s:.1f} s", flush=True)

        max_running, finished = 0, []

        def all_done() -> bool:
            nonlocal max_running, finished
            rs = runs(url, "sweep_member_job")
            max_running = max(max_running, sum(r["status"] == "STARTED" for r in rs))
            failed = [r for r in rs if r["status"] in ("FAILURE", "CANCELED")]
            if failed:
                raise RuntimeError(f"member runs failed: {failed}")
            finished = [r for r in rs if r["status"] == "SUCCESS"]
            return len(finished) == args.members

        wait(all_done, args.timeout, "all members succeeded")
        run_s = time.perf_counter() - t0

    print()
    print(f"{'members':>8} {'limit':>6} {'queued in':>10} {'max running':>12} {'all done in':>12} {'bad axis':>9}")
    print(f"{args.members:>8} {args.max_concurrent:>6} {queue_s:>9.1f}s {max_running:>12} {run_s:>11.0f}s "
          f"{'rejected' if bad_rejected else 'LAUNCHED':>9}")
    print(json.dumps({"queue_s": round(queue_s, 2), "members": args.members, "max_concurrent": args.max_concurrent,
                      "max_running_seen": max_running, "all_succeeded": len(finished) == args.members,
                      "bad_axis_rejected": bad_rejected, "all_done_s": round(run_s, 1),
                      "wall_s": round(time.perf_counter() - t_start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
