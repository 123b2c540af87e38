"""A tpe sweep with `max_concurrent: 1` launched as the launchpad does, one member's run worker killed mid-training:
how many members train at once, whether TPE asked its next trial before it had the killed member's result, and
whether the summary's best member, accuracy and ranking agree with `factory best` (issue 32, points 3, 7, 10).

Starts the cockpit (`dagster dev`: webserver, daemon with run retries and run monitoring, code server; and the MLflow
UI) on 127.0.0.1 with a temp FACTORY_HOME, launches the `sweep` job through the webserver's GraphQL API (the
launchpad's mutation) with `mode: tpe`, `trials` tiny members, `max_concurrent: 1` and the median pruner, and
SIGKILLs the run worker of the member of trial `--kill-trial` once its trainer has finished step `--kill-at` (only
the pid that run's own engine event recorded). Every 0.5 s through the whole sweep a sampler thread counts:

- members training: GRPO trainers alive, i.e. the attempt locks under FACTORY_HOME/checkpoints held right now (read
  from /proc/locks, so the sampler never takes a lock a trainer may be acquiring); the killed run's orphaned trainer
  counts until it stops at its resume point;
- runs in flight as Dagster has them (queued, starting, started), and runs holding a slot as the launcher counts them
  (also a failed run awaiting its automatic retry), each counted once per member or warm start.

At the end: when the killed member's retry was created and when the next trial's run was, whether that trial was
asked after the killed trial's result was in the study (Optuna's datetime_complete / datetime_start), the summary's
best member, accuracy, ranking and `ranked_by` against `factory best --metric accuracy --sweep`, each member's
status in the `sweeps` and `runs` tables, on its MLflow run (`factory.status`) and its Dagster run
(`factory/status`), and the MLflow parent run's status and member count.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sweep_kill.py              # 3 trials, kill trial 1 at step 7
    PYTHONPATH=$PWD .venv/bin/python benchmarks/sweep_kill.py --quick --port 3300

Prints a table, then one JSON line: max_members_training, max_runs_in_flight, max_slots_held, over_limit (the
samples above 1, seconds from the kill, which members), max_concurrent, samples, killed_member, kill_to_retry_s,
next_trial_run_after_retry_s, next_trial_asked_after_result, summary_best, best_best, agree, statuses, parent,
wall_s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sweep_queue import launch, wait  # noqa: E402
from factory.ops.cockpit import cockpit  # noqa: E402

# The quickstart's tiny model and SFT warm start (held-out accuracy ~0.3), 20 GRPO steps: members that learn apart.
OVERRIDES = ["task.n_eval=200", "rollout.prompts_per_step=16", "algorithm.group_size=4", "schedule.steps=20",
             "schedule.eval_every=5", "schedule.eval_pass_k=4", "ops.resume_every=2", "ops.preflight=off"]
# --quick: a micro model that learns nothing (every accuracy 0: the ranking is one tie), minutes less
QUICK = ["model.preset=micro", "task.n_train=200", "task.n_eval=50", "sft.steps=10", "sft.stop_at_accuracy=null",
         "rollout.prompts_per_step=4", "algorithm.group_size=2", "schedule.steps=8", "schedule.eval_every=2",
         "schedule.eval_pass_k=2", "ops.resume_every=2", "ops.preflight=off"]
SPACE = {"algorithm.lr": {"low": 1.0e-5, "high": 3.0e-3, "log": True}}
SWEEP_TAG, MEMBER_TAG, STATUS_TAG = "factory/sweep_id", "factory/member", "factory/status"
DAGSTER_IN_FLIGHT = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING")


def held_locks() -> set[int]:
    """Inodes of the files someone holds an flock on now (/proc/locks), read without taking any lock."""
    inodes = set()
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if "FLOCK" in parts and len(parts) > 5:
            inodes.add(int(parts[5].rsplit(":", 1)[1]))
    return inodes


def trainers(checkpoints: Path) -> list[str]:
    """The runs whose attempt lock is held now: their trainers are alive."""
    held = held_locks()
    out = []
    for lock in checkpoints.glob("*/attempt.lock"):
        try:
            if lock.stat().st_ino in held:
                out.append(lock.parent.name)
        except FileNotFoundError:
            continue
    return out


class Sampler(threading.Thread):
    """Every `every_s`: trainers alive, Dagster runs of the sweep in flight, slots held as the launcher counts."""

    def __init__(self, dagster_home: Path, checkpoints: Path, sweep_id: str, every_s: float = 0.5):
        from dagster import DagsterInstance

        super().__init__(daemon=True)
        self.instance = DagsterInstance.from_config(str(dagster_home))  # its own: the main thread has one too
        self.checkpoints, self.sweep_id, self.every_s = checkpoints, sweep_id, every_s
        self.stop = threading.Event()
        self.samples: list[dict] = []
        self.errors = 0

    def run(self) -> None:
        from dagster import RunsFilter

        from jobs._queue import holds_slot

        while not self.stop.wait(self.every_s):
            try:
                runs = self.instance.get_runs(RunsFilter(tags={SWEEP_TAG: self.sweep_id}))
                keys: dict[str, list] = {}
                for r in runs:  # training runs only (the summary's run carries the sweep's tag too)
                    key = r.tags.get(MEMBER_TAG) or r.tags.get("factory/warm_start")
                    if key:
                        keys.setdefault(key, []).append(r)
                flying = sorted(k for k, rs in keys.items() if any(r.status.value in DAGSTER_IN_FLIGHT for r in rs))
                slots = sorted(k for k, rs in keys.items() if any(holds_slot(self.instance, r) for r in rs))
                self.samples.append({"t": time.time(), "training": trainers(self.checkpoints), "in_flight": flying,
                                     "slots": slots})
            except Exception:  # a sample that raced a write: the next one counts
                self.errors += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--kill-trial", type=int, default=1, help="the trial whose member's run worker is killed")
    ap.add_argument("--kill-at", type=int, default=7, help="kill once its trainer finished this step")
    ap.add_argument("--quick", action="store_true", help="a micro model, 8 steps (accuracies all 0)")
    ap.add_argument("--port", type=int, default=3300, help="Dagster UI port (the MLflow UI takes the next one)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the sweep's summary")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    os.environ.setdefault("FACTORY_FAULT_DIR", tempfile.mkdtemp(prefix="sweep-kill-faults-"))
    os.environ.setdefault("FACTORY_FAULT_HOLD_S", "publish:0.3")  # a few seconds a step: the kill lands mid-run
    tmp = Path(tempfile.mkdtemp(prefix="sweep-kill-"))
    home = tmp / "factory-home"
    with cockpit(home, args.port, args.port + 1) as (ui, _mlflow):
        from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

        from factory.home import factory_home
        from factory.runs.attempt import beat_step
        from resources.run_launcher import worker_pid

        paths = factory_home(home)
        instance = DagsterInstance.from_config(str(paths.dagster_home))
        t0 = time.time()
        launch(ui.url, {"name": "kill", "base_spec": str(ROOT / "examples" / "quickstart.yaml"),
                        "overrides": QUICK if args.quick else OVERRIDES,
                        "mode": "tpe", "space": SPACE, "trials": args.trials, "max_concurrent": 1,
                        "prune": "median", "prune_startup_trials": 1, "draw_seed": 0})
        sweep_dir = wait(lambda: next((p for p in (home / "sweeps").glob("kill-*") if (p / "sweep.json").is_file()),
                                      None) if (home / "sweeps").is_dir() else None, 300, "the sweep planned")
        sweep_id = sweep_dir.name
        sampler = Sampler(paths.dagster_home, paths.checkpoints, sweep_id)
        sampler.start()

        def member_run(trial: int):
            runs = instance.get_runs(RunsFilter(tags={SWEEP_TAG: sweep_id, "factory/trial": str(trial)}))
            return min(runs, key=lambda r: r.tags.get("dagster/retry_number", "0")) if runs else None

        def ready_to_kill():
            run = member_run(args.kill_trial)
            if run is None or run.status.value != "STARTED":
                return None
            dirs = list(paths.checkpoints.glob(f"kill-m{args.kill_trial:03d}-{run.run_id[:8]}"))
            return run if dirs and (beat_step(dirs[0]) or 0) >= args.kill_at else None

        victim = wait(ready_to_kill, args.timeout, f"trial {args.kill_trial} at step {args.kill_at}", every=0.2)
        pid = worker_pid(instance, victim.run_id)[0]
        os.kill(pid, signal.SIGKILL)  # the run worker of our own sweep's run, by the pid its engine event recorded
        killed_at = time.time()
        print(f"killed run worker {pid} of {victim.tags[MEMBER_TAG]} (Dagster run {victim.run_id[:8]})", flush=True)

        def summarized():
            done = instance.get_runs(RunsFilter(job_name="sweep_summary_job", tags={SWEEP_TAG: sweep_id},
                                                statuses=[DagsterRunStatus.SUCCESS]))
            return done or None

        wait(summarized, args.timeout, "the sweep's summary", every=1.0)
        sampler.stop.set()
        sampler.join(timeout=10)
        report = collect(instance, paths, sweep_id, victim, killed_at, home)
        all_done_s = time.time() - t0
    samples = sampler.samples
    over = {what: [f"{s['t'] - killed_at:+.1f}s {','.join(map(short_key, s[what]))}" for s in samples
                   if len(s[what]) > 1] for what in ("training", "in_flight", "slots")}
    out = {
        "max_members_training": max((len(s["training"]) for s in samples), default=0),
        "max_runs_in_flight": max((len(s["in_flight"]) for s in samples), default=0),
        "max_slots_held": max((len(s["slots"]) for s in samples), default=0),
        # the samples above the limit, seconds from the kill and which members: the first and last 3 of each
        "over_limit": {k: v[:3] + (["..."] + v[-3:] if len(v) > 6 else v[3:6]) for k, v in over.items() if v},
        "over_limit_samples": {k: len(v) for k, v in over.items()},
        "max_concurrent": 1, "samples": len(samples), "sample_errors": sampler.errors,
        "sampled_s": round(samples[-1]["t"] - samples[0]["t"], 1) if samples else 0.0,
        **report, "all_done_s": round(all_done_s, 1), "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print()
    print(f"{'trials':>6} {'limit':>5} {'samples':>8} {'max training':>12} {'max in flight':>13} {'max slots':>9} "
          f"{'kill->retry':>11} {'next trial after retry':>22} {'TPE had result':>14} {'summary = best':>14}")
    print(f"{args.trials:>6} {1:>5} {len(samples):>8} {out['max_members_training']:>12} "
          f"{out['max_runs_in_flight']:>13} {out['max_slots_held']:>9} {_s(out['kill_to_retry_s']):>11} "
          f"{_s(out['next_trial_run_after_retry_s']):>22} {str(out['next_trial_asked_after_result']):>14} "
          f"{str(out['agree']):>14}")
    print(f"summary: best {out['summary_best']}; ranked_by: {out['ranked_by']}")
    print(f"factory best: {out['best_best']}")
    for key, st in out["statuses"].items():
        print(f"  {key}: {st}")
    print(f"MLflow parent: {out['parent']}")
    for note in out["spared"]:
        print(f"not pruned: {note}")
    for what, seen in out["over_limit"].items():
        print(f"above the limit ({what}, s from the kill): {'; '.join(seen)}")
    print(json.dumps(out))
    return 0


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def collect(instance, paths, sweep_id: str, victim, killed_at: float, home: Path) -> dict:
    """What the sweep left: retry and next-trial timing, TPE's order, the summary against `factory best`, statuses."""
    import optuna
    from dagster import AssetKey, RunsFilter

    from factory.cockpit.sweep_search import open_storage, study_storage_url
    from factory.cockpit.tracking import Tracker
    from factory.lake import Lake

    runs = instance.get_runs(RunsFilter(tags={SWEEP_TAG: sweep_id}))
    retry = next((r for r in runs if r.parent_run_id == victim.run_id), None)
    retry_at = instance.get_run_record_by_id(retry.run_id).create_timestamp.timestamp() if retry else None
    nxt_trial = int(victim.tags["factory/trial"]) + 1
    nxt = [r for r in runs if r.tags.get("factory/trial") == str(nxt_trial) and r.parent_run_id is None]
    nxt_at = instance.get_run_record_by_id(nxt[0].run_id).create_timestamp.timestamp() if nxt else None
    study = optuna.load_study(study_name=sweep_id, storage=open_storage(study_storage_url(paths, None)))
    trials = {t.number: t for t in study.get_trials()}
    killed_t, next_t = trials.get(int(victim.tags["factory/trial"])), trials.get(nxt_trial)
    asked_after = (killed_t is not None and next_t is not None and killed_t.datetime_complete is not None
                   and killed_t.datetime_complete <= next_t.datetime_start)

    (mat,) = [e.asset_materialization for e in instance.fetch_materializations(
        AssetKey("sweep_summary"), limit=100).records if e.partition_key == sweep_id][:1]
    md = {k: v.value for k, v in mat.metadata.items()}
    table = [r.data for r in md["members_table"].records]
    with Lake.open(paths) as lake:
        rows = {r["member"]: r for r in lake.read("sweeps", f"sweep_id = '{sweep_id}'").to_pylist()}
        run_rows = {r["run_id"]: r for r in lake.read("runs", f"sweep_id = '{sweep_id}'").to_pylist()}
    short = {short_key(k): k for k in rows}
    ranked = [r for r in table if r.get("rank") is not None] if "rank" in (table[0] if table else {}) else \
        [r for r in table if r["status"] == "succeeded"]
    summary_order = [rows[short[r["member"]]]["run_id"] for r in ranked]
    best = json.loads(subprocess.run([sys.executable, "-m", "factory.cli", "best", "--metric", "accuracy", "--sweep",
                                      sweep_id, "--format", "json"], env={**os.environ, "FACTORY_HOME": str(home)},
                                     capture_output=True, text=True, check=True).stdout)
    best_order = [r["run_id"] for r in best]
    best_member = md.get("best_member", "")
    top = best_member.removeprefix("tie: ").split(", ")[0]  # a tie names the rank-1 member first
    agree = bool(best) and rows.get(top, {}).get("run_id") == best_order[0] \
        and md.get("best_accuracy") == best[0]["value"] and summary_order == best_order

    tracker = Tracker(paths)
    statuses = {}
    for key, row in sorted(rows.items()):
        run = run_rows.get(row["run_id"] or "", {})
        mlflow_status = ""
        if run.get("mlflow_run_id"):
            got = tracker.get_run(run["mlflow_run_id"])
            mlflow_status = f"{got.info.status}/{got.data.tags.get('factory.status', '-')}"
        dagster = [r for r in runs if r.tags.get(MEMBER_TAG) == key]
        statuses[short_key(key)] = {"sweeps": row["status"], "runs": run.get("status"), "mlflow": mlflow_status,
                                    "dagster": [f"{r.status.value}/{r.tags.get(STATUS_TAG, '-')}" for r in
                                                sorted(dagster, key=lambda r: r.tags.get("dagster/retry_number", "0"))],
                                    "reason": row.get("reason")}
    # what the pruner said and did not act on (the difference inside the noise), from the member runs' logs
    spared = sorted({e.user_message for r in runs if MEMBER_TAG in r.tags for e in instance.all_logs(r.run_id)
                     if "inside the noise" in (e.user_message or "")})
    parent_id = next((r["mlflow_parent_run_id"] for r in rows.values() if r["mlflow_parent_run_id"]), None)
    parent = tracker.get_run(parent_id) if parent_id else None
    return {
        "sweep_id": sweep_id, "killed_member": victim.tags[MEMBER_TAG],
        "kill_to_retry_s": round(retry_at - killed_at, 1) if retry_at else None,
        "next_trial_run_after_retry_s": round(nxt_at - retry_at, 1) if nxt_at and retry_at else None,
        "next_trial_asked_after_result": asked_after,
        "killed_trial_state": killed_t.state.name if killed_t else None,
        "summary_best": f"{best_member} {md.get('best_accuracy')} {md.get('best_accuracy_ci95')}",
        "ranked_by": md.get("ranked_by"), "verdict": md.get("verdict"),
        "best_best": [f"{r['run_id']} {r['value']} {r['ci95']}" for r in best],
        "summary_order": summary_order, "best_order": best_order, "agree": agree, "statuses": statuses,
        "spared": spared,
        "parent": (f"{parent.info.status}, members {parent.data.tags.get('factory.members')}" if parent else None),
    }


def short_key(key: str) -> str:
    found = re.search(r"-(m\d{3})(-|$)", key)
    return found.group(1) if found else key


if __name__ == "__main__":
    sys.exit(main())
