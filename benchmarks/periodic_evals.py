"""Seconds per periodic eval, before and after the eval server, side by side in one run.

A tiny quickstart run (model.preset=micro, a few steps, a checkpoint every step) is trained here; then each of its
N checkpoints is evaluated on one benchmark as the demo does it: a Dagster run of `checkpoint_eval_job` per
partition, submitted to the run queue of a real instance with Factory's settings (factory/ops/instance.py), launched
onto a run worker process by the code server of workspace.yaml, one at a time (the eval limit is 1).
- before: `eval_server: false` (each run worker imports torch/transformers, loads the model and evaluates);
- after: the default (the first eval starts the home's eval server; each run worker asks it).
The rows the "before" runs wrote are deleted in between, so "after" evaluates for real instead of reusing them, and
the accuracies of both must agree.

Where the time goes comes from each run's event log (launch -> run worker started -> step process started -> step
body -> run end) and, for the in-process eval, from timing its parts in a fresh process (imports, model load, eval).

    PYTHONPATH=. python benchmarks/periodic_evals.py [--n 3] [--benchmark carry_chains]

Prints a table for people and a last JSON line: seconds_per_eval_before, seconds_per_eval_after, ratio, n, ...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["name=pevals", "model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10",
        "sft.stop_at_accuracy=null", "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.eval_pass_k=2",
        "trainer.threads=1", "ops.preflight=off", "schedule.checkpoint_every=1"]

PARTS = """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers  # noqa
torch.set_num_threads(1)
import factory.runs.stages  # noqa
t1 = time.perf_counter()
from factory.config import parse_spec
from factory.home import factory_home
from factory.lake import Lake
from factory.runs.stages import build_dataset, evaluate_checkpoint, load_dataset, load_checkpoint
from factory.envs.eval_suites import benchmark_problems
paths = factory_home(sys.argv[1]); lake = Lake.open(paths)
run = lake.read("runs").to_pylist()[0]
spec = parse_spec(json.loads(run["spec"]))
ck = [r for r in lake.read("checkpoints").to_pylist() if r["step"] == int(sys.argv[2])][0]
problems = benchmark_problems(sys.argv[3], spec.task, load_dataset(build_dataset(spec, paths).path))
t2 = time.perf_counter()
uri = ck["uri"].removeprefix("file://")
load_checkpoint(uri)
t3 = time.perf_counter()
evaluate_checkpoint(spec, uri, problems)
t4 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "lake_and_problems": t2 - t1, "model_load": t3 - t2,
                  "load_and_eval": t4 - t3}))
"""


def _train(home: Path, steps: int) -> str:
    """The tiny quickstart run; its run_id."""
    from factory.cockpit.tracking import Tracker
    from factory.config import apply_overrides, load_spec, parse_overrides
    from factory.home import factory_home
    from factory.lake import Lake
    from factory.runs.rl_run import run_rl
    from factory.runs.stages import build_dataset, load_dataset, train_sft_checkpoint

    paths = factory_home(home)
    spec = apply_overrides(load_spec(ROOT / "examples" / "quickstart.yaml"),
                           parse_overrides([*TINY, f"schedule.steps={steps}"]))
    splits = load_dataset(build_dataset(spec, paths).path)
    sft = train_sft_checkpoint(spec, paths, splits, log=lambda _: None)
    with Lake.open(paths) as lake:
        return run_rl(spec, paths, sft.checkpoint.path, splits, lake, Tracker(paths), log=lambda _: None).run_id


def _launch(instance, wpc, partition: str, checkpoint: str, use_server: bool) -> str:
    """Create and submit one run of checkpoint_eval_job for `partition`, as the sensor's RunRequest would."""
    from assets.evals import checkpoint_evals
    from benchmarks.dagster_submit import submit_as_the_ui
    from jobs._queue import EVAL_TAGS

    run_config = {"ops": {"checkpoint_eval": {"config": {"eval_server": use_server}}}}
    tags = {**EVAL_TAGS, "factory/checkpoint": checkpoint, **checkpoint_evals.get_tags_for_partition_key(partition)}
    return submit_as_the_ui(instance, wpc, "checkpoint_eval_job", "checkpoint_eval", run_config, tags).run_id


def _run_one(instance, wpc, partition: str, checkpoint: str, use_server: bool) -> dict:
    """Submit, let the queue launch it, wait for the end; seconds and where they went (from the event log)."""
    from dagster import DagsterEventType, DagsterRunStatus
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

    t0 = time.time()
    run_id = _launch(instance, wpc, partition, checkpoint, use_server)
    list(QueuedRunCoordinatorDaemon(interval_seconds=1).run_iteration(wpc))
    done = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
    deadline = time.monotonic() + 900
    while instance.get_run_by_id(run_id).status not in done:
        if time.monotonic() > deadline:
            raise SystemExit(f"run {run_id} of {partition} did not finish in 900 s")
        time.sleep(0.2)
    total = time.time() - t0
    status = instance.get_run_by_id(run_id).status
    events = [e for e in instance.all_logs(run_id) if e.dagster_event]
    if status != DagsterRunStatus.SUCCESS:
        raise SystemExit(f"run {run_id} of {partition}: {status}\n" + "\n".join(
            (e.dagster_event.message or "")[:400] for e in events[-8:]))

    def first(kind: DagsterEventType) -> float:
        return next(e.timestamp for e in events if e.dagster_event.event_type == kind)

    mat = next(e for e in events if e.dagster_event.event_type == DagsterEventType.ASSET_MATERIALIZATION)
    md = mat.dagster_event.event_specific_data.materialization.metadata
    return {"partition": partition, "seconds": total,
            "to_run_start": first(DagsterEventType.RUN_START) - t0,  # queue, run worker start, code load
            "to_step_start": first(DagsterEventType.STEP_START) - first(DagsterEventType.RUN_START),  # step process
            "step_body": first(DagsterEventType.STEP_SUCCESS) - first(DagsterEventType.STEP_START),
            "run_end": first(DagsterEventType.RUN_SUCCESS) - first(DagsterEventType.STEP_SUCCESS),
            "accuracy": md["accuracy"].value, "reused": md["reused"].value}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3, help="checkpoints evaluated each way (default 3)")
    p.add_argument("--benchmark", default="carry_chains", help="benchmark (default carry_chains: one the training "
                   "run does not record, so every eval is a real one)")
    args = p.parse_args()
    if args.n < 1:
        p.error(f"--n: expected >= 1, got {args.n}")
    tmp = Path(tempfile.mkdtemp(prefix="periodic-evals-"))
    home, dagster_home = tmp / "home", tmp / "dagster"
    os.environ["FACTORY_HOME"] = str(home)  # before the code server starts: it and its run workers inherit them
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    import torch

    torch.set_num_threads(1)
    from dagster import DagsterInstance
    from dagster._core.test_utils import create_test_daemon_workspace_context
    from dagster._core.workspace.load_target import WorkspaceFileTarget
    from pyiceberg.expressions import And, EqualTo

    from factory.home import factory_home
    from factory.lake import Lake
    from factory.ops.instance import ensure_instance_yaml
    from factory.runs.checkpoint_eval import checkpoint_key, eval_key, recorded_name
    from factory.runs.eval_server import stop_server

    t = time.time()
    run_id = _train(home, args.n)
    print(f"trained {run_id} ({args.n} checkpoints) in {time.time() - t:.0f} s", file=sys.stderr)
    paths = factory_home(home)
    steps = list(range(1, args.n + 1))
    parts = json.loads(subprocess.run([sys.executable, "-c", PARTS, str(home), str(steps[0]), args.benchmark],
                                      capture_output=True, text=True, check=True, cwd=ROOT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.splitlines()[-1])
    ensure_instance_yaml(dagster_home)
    rows: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        for way, use_server in (("before", False), ("after", True)):
            # before: Dagster's default executor (a step process per run), as the code location had it; the code
            # server, started per way, and its run workers read FACTORY_EVAL_EXECUTOR when they load it
            os.environ["FACTORY_EVAL_EXECUTOR"] = "multiprocess" if way == "before" else "in_process"
            if way == "after":  # evaluate again for real: the rows "before" wrote would be reused
                with Lake.open(paths) as lake:
                    lake.delete("evals", And(EqualTo("run_id", run_id),
                                             EqualTo("benchmark", recorded_name(args.benchmark))))
            with DagsterInstance.get() as instance, create_test_daemon_workspace_context(
                    WorkspaceFileTarget(paths=[str(ROOT / "workspace.yaml")]), instance) as wpc:
                instance.add_dynamic_partitions("checkpoint_evals", [eval_key(checkpoint_key(run_id, s), args.benchmark)
                                                                     for s in steps])
                for s in steps:
                    key = checkpoint_key(run_id, s)
                    partition = eval_key(key, args.benchmark)
                    r = _run_one(instance, wpc, partition, key, use_server)
                    print(f"{way:6s} {partition}: {r['seconds']:.1f} s", file=sys.stderr)
                    rows[way].append(r)
    finally:
        stop_server(paths)
        shutil.rmtree(tmp, ignore_errors=True)
    _report(rows, parts, args.n)


def _report(rows: dict[str, list[dict]], parts: dict, n: int) -> None:
    cols = ("seconds", "to_run_start", "to_step_start", "step_body", "run_end")
    print(f"{'way':7s} {'checkpoint':>10s} " + " ".join(f"{c:>13s}" for c in cols) + "  accuracy")
    for way, rs in rows.items():
        for i, r in enumerate(rs, 1):
            print(f"{way:7s} {i:>10d} " + " ".join(f"{r[c]:13.1f}" for c in cols) + f"  {r['accuracy']:.3f}")
    print("in-process eval, timed in a fresh process: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
    before = statistics.mean(r["seconds"] for r in rows["before"])
    after = statistics.mean(r["seconds"] for r in rows["after"])
    warm = [r["seconds"] for r in rows["after"][1:]]
    identical = [r["accuracy"] for r in rows["before"]] == [r["accuracy"] for r in rows["after"]]
    print(json.dumps({"seconds_per_eval_before": round(before, 2), "seconds_per_eval_after": round(after, 2),
                      "ratio": round(before / after, 2), "n": n,
                      "seconds_per_eval_after_warm": round(statistics.mean(warm), 2) if warm else None,
                      "first_eval_after_s": round(rows["after"][0]["seconds"], 2),
                      "accuracies_identical": identical,
                      "reused_any": any(r["reused"] for rs in rows.values() for r in rs),
                      "in_process_parts_s": {k: round(v, 2) for k, v in parts.items()},
                      "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
