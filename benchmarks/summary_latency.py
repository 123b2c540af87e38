"""Minutes from a sweep's last member ending to its summary: the summarizer and eval sensors before and after
"the summary arrives within a minute, late evals update it".

Simulates the tail of a sweep without training, on a temp Dagster instance (ephemeral: the eval limit and the
summary limit are 1) and a temp lake: --members members end --end-gap-s apart (the last at t = 0), each recording
--checkpoints checkpoints (--ckpt-gap-s apart, the last as it ends), every checkpoint owing an eval per benchmark
(held-out split and carry_chains). The sensors are the real ones; they are ticked as the daemon ticks them, every
--tick-s seconds of simulated time (new_checkpoint_evals, then sweep_summarizer, each with its own cursor), and what
they request is "launched" as a run record the way the daemon would (a run key once); an eval run ends after a
duration drawn uniformly from --eval-s (the issue's 52-182 s, mostly process start-up), lands as a materialization
of its partition, and a summary run ends after --summary-s. Three policies: "before", the sensors as they were at
--before (the summary waited for every eval; its 600 s wait read from the simulated clock); "shared", as they were
at --shared (summaries in the eval queue, the first and complete ones ahead of evals); "after", the current ones
(summaries in a queue of their own). Old sensors are `git show`s of jobs/_queue.py, jobs/_summary.py, jobs/evals.py
and jobs/sweeps.py at the commit. The run records carry the tags the sensors request, so a summary of "after" takes
no eval slot.

What it measures: the sensors' policy (who gets a slot when, how long the summary waits), with the run
durations as given. Not measured: how long an eval or a summary really takes, the daemon's own tick jitter (real
ticks every ~30 s at the sensors' minimum intervals), run start-up in a queued run coordinator.

    .venv/bin/python benchmarks/summary_latency.py               # 3 seeds, the issue's eval durations
    .venv/bin/python benchmarks/summary_latency.py --eval-s 5,15 # evals served by one process

Prints a table (per policy: minutes from the last member's end to the first summary, to the complete one, and how
many evals the first one had pending), then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FACTORY_PREFLIGHT", "off")

from dagster import (  # noqa: E402
    AssetMaterialization,
    DagsterInstance,
    DagsterRunStatus,
    build_sensor_context,
)
from dagster._core.test_utils import create_run_for_test  # noqa: E402

from assets._pending import progress  # noqa: E402
from assets.sweeps import sweep_members, sweeps, warm_starts  # noqa: E402
from factory.cockpit.sweep import SweepDefinition, plan_sweep, write_sweep  # noqa: E402
from factory.config import parse_overrides  # noqa: E402
from factory.home import factory_home  # noqa: E402
from factory.lake import Lake  # noqa: E402
from resources import FactoryHomeResource, LakeResource, MlflowResource  # noqa: E402

T0 = datetime(2026, 1, 1, tzinfo=UTC)  # simulated t = 0: the last member ends
BEFORE = "d9118b3"  # main before "the summary arrives as the members end" (the summary waited for every eval)
SHARED = "17c1ecd"  # main while summaries shared the eval limit with checkpoint evals (a slot held for them)


class SimClock:
    """Stands in for `datetime` in the old summarizer, whose 600 s wait reads the clock."""

    now_s = 0.0

    @classmethod
    def now(cls, tz=None) -> datetime:
        return T0 + timedelta(seconds=cls.now_s)


def load_at(ref: str, prefix: str) -> tuple[ModuleType, ModuleType]:
    """The sensors as of `ref`: jobs/_queue.py, jobs/_summary.py (where it exists), jobs/evals.py and jobs/sweeps.py,
    loaded beside the current ones as modules `<prefix>_queue`, ... (importing each other, not the current ones)."""
    mods = {}
    names = [n for n in ("_queue", "_summary", "evals", "sweeps") if _exists(ref, f"jobs/{n}.py")]
    for name in names:
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:jobs/{name}.py"], check=True,
                             capture_output=True, text=True).stdout
        for dep in names:
            src = src.replace(f"from jobs.{dep} import", f"from {prefix}_{dep.lstrip('_')} import")
        if name == "sweeps":  # only its sensors: the `sweep` jobs' config classes cannot be defined twice
            cut = src.index("class SweepConfig(Config):"), src.index("def _sweep_ids(")
            src = src[:cut[0]] + src[cut[1]:]
        spec = importlib.util.spec_from_loader(f"{prefix}_{name.lstrip('_')}", loader=None)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        exec(compile(src, f"{ref}:jobs/{name}.py", "exec"), mod.__dict__)  # noqa: S102 (our own file at a commit)
        mods[name] = mod
    mods["sweeps"].datetime = SimClock
    return mods["evals"].new_checkpoint_evals, mods["sweeps"].sweep_summarizer


def _exists(ref: str, path: str) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{ref}:{path}"], capture_output=True,
                          check=False).returncode == 0


def load_after() -> tuple:
    from jobs.evals import new_checkpoint_evals
    from jobs.sweeps import sweep_summarizer

    return new_checkpoint_evals, sweep_summarizer


@dataclass
class Outcome:
    first_s: float | None = None  # last member's end -> first summary materialized
    first_pending: int | None = None
    complete_s: float | None = None  # -> a summary with no eval pending materialized
    summaries: int = 0
    evals: int = 0
    ticks: int = 0
    sensor_s: list[float] = field(default_factory=list)  # wall time per sensor evaluation


def simulate(policy: str, sensors: tuple, args: argparse.Namespace, seed: int) -> Outcome:
    rng = random.Random(seed)
    evals_sensor, summarizer = sensors
    tmp = Path(tempfile.mkdtemp(prefix="summary-latency-"))
    paths = factory_home(tmp / "home")
    home = FactoryHomeResource(root=str(paths.root))
    resources = {"home": home, "lake": LakeResource(home=home), "mlflow": MlflowResource(home=home)}
    lake = Lake.open(paths)
    out = Outcome()
    with DagsterInstance.ephemeral() as instance:
        plan = plan_sweep(SweepDefinition(name="bench", base_spec=str(ROOT / "examples" / "quickstart.yaml"),
                                          overrides=parse_overrides(["schedule.steps=60"]), max_concurrent=2,
                                          axes={"algorithm.lr": [1e-4 * (i + 1) for i in range(args.members)]}))
        instance.add_dynamic_partitions(warm_starts.name, list(plan.warm_starts()))
        instance.add_dynamic_partitions(sweep_members.name, [m.key for m in plan.members])
        instance.add_dynamic_partitions(sweeps.name, [plan.sweep_id])
        write_sweep(plan, paths)
        ends = [-(args.members - 1 - i) * args.end_gap_s for i in range(args.members)]
        events = []  # (t, kind, payload)
        for i, (m, end) in enumerate(zip(plan.members, ends, strict=True)):
            lake.upsert("sweeps", [_row(plan.sweep_id, m.key, i, "running", -3600.0)])
            for k in range(args.checkpoints):
                events.append((end - (args.checkpoints - 1 - k) * args.ckpt_gap_s, "checkpoint", (i, k)))
            events.append((end, "member_end", (i, m.key)))
        running: dict[str, tuple[float, object, int]] = {}  # run_id -> (end t, run, evals pending; -1: an eval)
        ids = {f"run-{i}" for i in range(args.members)}
        seen_keys, cursors = set(), {"evals": None, "summary": None}
        t = min(e[0] for e in events) - args.tick_s
        while t <= args.horizon_s and out.complete_s is None:
            SimClock.now_s = t
            for e in sorted([e for e in events if e[0] <= t], key=lambda e: e[0]):
                events.remove(e)
                _apply(e, lake, plan.sweep_id)
            for run_id, (end, run, pending) in sorted(running.items(), key=lambda kv: kv[1][0]):
                if end > t:
                    continue
                del running[run_id]
                instance.delete_run(run_id)
                create_run_for_test(instance, job_name=run.job_name, tags=run.tags, status=DagsterRunStatus.SUCCESS)
                if pending < 0:
                    instance.report_runless_asset_event(AssetMaterialization(
                        "checkpoint_eval", partition=run.tags["dagster/partition"]))
                    out.evals += 1
                else:
                    out.summaries += 1
                    if out.first_s is None:
                        out.first_s, out.first_pending = end, pending
                    if pending == 0 and out.complete_s is None:
                        out.complete_s = end
            for name, sensor in (("evals", evals_sensor), ("summary", summarizer)):
                start = time.perf_counter()
                with build_sensor_context(instance=instance, cursor=cursors[name], resources=resources) as ctx:
                    res = sensor(ctx)
                out.sensor_s.append(time.perf_counter() - start)
                cursors[name] = res.cursor
                for add in res.dynamic_partitions_requests or []:
                    instance.add_dynamic_partitions(add.partitions_def_name, add.partition_keys)
                for req in res.run_requests:
                    if req.run_key in seen_keys:  # the daemon launches a run key once
                        continue
                    seen_keys.add(req.run_key)
                    kind = "eval" if name == "evals" else "summary"
                    job = "checkpoint_eval_job" if kind == "eval" else "sweep_summary_job"
                    run = create_run_for_test(instance, job_name=job, status=DagsterRunStatus.STARTED,
                                              tags={**req.tags, "dagster/partition": str(req.partition_key)})
                    if kind == "eval":
                        running[run.run_id] = (t + rng.uniform(*args.eval_s), run, -1)
                    else:  # the summary is drawn from the evals landed when it starts
                        running[run.run_id] = (t + args.summary_s, run, len(progress(instance, lake, ids).pending))
            out.ticks += 1
            # the next moment anything can change: a tick, or a run ending (it is seen at the tick after it)
            t += args.tick_s
    return out


def _row(sweep_id: str, key: str, i: int, status: str, at: float) -> dict:
    return dict(sweep_id=sweep_id, member=key, name="bench", axes=json.dumps({"i": i}), spec="{}", status=status,
                run_id=f"run-{i}", final_accuracy=0.5 if status == "succeeded" else None, created_at=T0,
                recorded_at=T0 + timedelta(seconds=at))


def _apply(event: tuple, lake: Lake, sweep_id: str) -> None:
    at, kind, payload = event
    if kind == "checkpoint":
        i, k = payload
        lake.upsert("checkpoints", [dict(run_id=f"run-{i}", step=(k + 1) * 20, kind="rl", uri=f"/ckpt/{i}/{k}",
                                         bytes=1, sha256="0" * 64, recorded_at=T0 + timedelta(seconds=at))])
    else:
        i, key = payload
        lake.upsert("sweeps", [_row(sweep_id, key, i, "succeeded", at)])


def _minutes(v: float | None) -> str:
    return "never" if v is None else f"{v / 60:.1f}"


def main(argv: list[str] | None = None) -> int:
    import torch

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=3)
    ap.add_argument("--checkpoints", type=int, default=2, help="checkpoints per member, the last as it ends")
    ap.add_argument("--ckpt-gap-s", type=float, default=60.0)
    ap.add_argument("--end-gap-s", type=float, default=120.0, help="between one member's end and the next's")
    ap.add_argument("--eval-s", type=lambda s: tuple(float(x) for x in s.split(",")), default=(52.0, 182.0),
                    help="an eval run's duration, drawn uniformly from LOW,HIGH seconds")
    ap.add_argument("--summary-s", type=float, default=30.0, help="a summary run's duration")
    ap.add_argument("--tick-s", type=float, default=30.0, help="simulated seconds between daemon ticks")
    ap.add_argument("--horizon-s", type=float, default=3600.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--before", default=BEFORE, help="the commit whose sensors are the old policy")
    ap.add_argument("--shared", default=SHARED, help="the commit whose sensors are the shared-limit policy (summaries "
                    "in the eval queue, a slot held for them); '' leaves it out")
    args = ap.parse_args(argv)
    wall = time.perf_counter()
    policies = {"before": load_at(args.before, "before"),
                **({"shared": load_at(args.shared, "shared")} if args.shared else {}), "after": load_after()}
    results: dict[str, list[Outcome]] = {p: [] for p in policies}
    for seed in range(args.seeds):
        for name, sensors in policies.items():
            results[name].append(simulate(name, sensors, args, seed))
    print(f"\n{args.members} members ending {args.end_gap_s:.0f} s apart, {args.checkpoints} checkpoint(s) each x 2 "
          f"benchmarks; evals {args.eval_s[0]:.0f}-{args.eval_s[1]:.0f} s, summary {args.summary_s:.0f} s, eval "
          f"limit 1 (after: summary limit 1 beside it), ticks every {args.tick_s:.0f} s; minutes after the last "
          "member's end")
    print(f"{'policy':>8} {'seed':>5} {'first summary':>14} {'pending in it':>14} {'complete summary':>17} "
          f"{'summaries':>10} {'ticks':>6}")
    for name, outs in results.items():
        for seed, o in enumerate(outs):
            print(f"{name:>8} {seed:>5} {_minutes(o.first_s):>14} {o.first_pending!s:>14} "
                  f"{_minutes(o.complete_s):>17} {o.summaries:>10} {o.ticks:>6}")
    summary = {}
    for name, outs in results.items():
        firsts = [o.first_s for o in outs if o.first_s is not None]
        completes = [o.complete_s for o in outs if o.complete_s is not None]
        summary[name] = {
            "first_summary_min": [None if o.first_s is None else round(o.first_s / 60, 2) for o in outs],
            "first_summary_median_min": round(statistics.median(firsts) / 60, 2) if firsts else None,
            "pending_in_first": [o.first_pending for o in outs],
            "complete_summary_min": [None if o.complete_s is None else round(o.complete_s / 60, 2) for o in outs],
            "complete_summary_median_min": round(statistics.median(completes) / 60, 2) if completes else None,
            "summaries": [o.summaries for o in outs],
            "sensor_eval_median_s": round(statistics.median(s for o in outs for s in o.sensor_s), 3),
        }
    print(json.dumps({**summary, "members": args.members, "checkpoints": args.checkpoints,
                      "eval_s": list(args.eval_s), "summary_s": args.summary_s, "tick_s": args.tick_s,
                      "seeds": args.seeds, "before_ref": args.before,
                      "shared_ref": args.shared, "wall_s": round(time.perf_counter() - wall, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
