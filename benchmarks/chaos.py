"""Chaos: kill -9 the trainer, the rollout server or an environment worker at random moments of real runs, and
check that every run finishes with a result as if nothing had happened.

Three runs of the tiny model (`factory run`, supervised: each attempt is a child process restarted from its
newest resume point), each with its environment workers as separate processes:
1. `sync` with kills (trainer, environment worker): the final weights must be bit-identical (sha256) to an
   uninterrupted run of the same spec and seed, which runs first;
2. `async` with the rollout server as a process too, and kills of all three, some timed to land while a
   resume point is being written and while weights are being published: no `steps` row and no trained prompt
   (draw) may be duplicated or skipped;
3. a longer `sync` run with the trainer killed every `--long-every` seconds, for goodput.

Kill moments are drawn from a seeded RNG; "during a checkpoint write" and "during a weight publish" wait for
the process to be at that fault point (`factory/infra/faults.py`, which holds each briefly so the kill lands).
The breaker is widened for these runs (ops.breaker_restarts = 50): here the crashes are the point.

Then the dependency and supervision faults (`benchmarks/chaos_faults.py`), each one real supervised run of the
tiny model struck once: a catalog outage mid-run (the SQLite catalog's write lock held, shorter than
ops.lake_outage_s), ENOSPC at a resume-point write, SIGKILL of the supervising `factory run`, SIGKILL of one rank
of a 2-rank data-parallel run; and the red-team reward hacks (`envs/reward_hacks.py`) and what one execution
leaves for a later one (`envs/redteam_carryover.py`).
Every run here is a `benchmarks/chaos_runs.py` `Run` (its run directory, heartbeat, attempt and lake rows).

Prints a table, then one JSON line with kills, survived, bit_identical_sync, duplicate_steps, missing_steps,
duplicate_prompts, skipped_prompts, resume_s_p50, goodput, save_stall_ms_p50 (and more), and one boolean per fault
(all must be true):
- lake_outage_survived: the run through the outage finished `succeeded`, rows were spooled meanwhile, and no
  `steps` row is duplicated or missing;
- disk_full_clean_stop: the run stopped with "disk full: DIR" and exit code EXIT_DISK_FULL, no traceback, 0
  restarts spent, the previous resume point intact; then `factory resume` finished it, every step once;
- supervisor_kill_survived: the orphaned attempt stopped at a resume point (cause supervisor_lost) and no process
  of the run was left running (/proc); then `factory resume` finished it, every step once;
- rank_kill_survived: the group was restarted after rank 1's SIGKILL and the run finished `succeeded`, every
  step once;
- reward_hacks_scored_zero: every red-team reward hack scored 0 and the honest control 1, and nothing one
  execution left reached a later one (the carry-over cases, `envs/redteam_carryover.py`).
`faults` holds what each fault run saw (and `why`, the first check that failed). `--only` runs some parts.

    .venv/bin/python benchmarks/chaos.py
    .venv/bin/python benchmarks/chaos.py --quick    # fewer kills and steps
    .venv/bin/python benchmarks/chaos.py --quick --only disk_full,reward_hacks
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos_runs import Run, lake_rows, wait_for  # noqa: E402

SPEC = ROOT / "examples" / "quickstart.yaml"
BASE = ["--set", "model.preset=tiny", "--set", "task.n_train=2000", "--set", "task.n_eval=32",
        "--set", "sft.steps=30", "--set", "sft.stop_at_accuracy=null", "--set", "rollout.prompts_per_step=8",
        "--set", "algorithm.group_size=4", "--set", "schedule.eval_pass_k=2", "--set", "schedule.eval_every=0",
        "--set", "trainer.threads=1", "--set", "rollout.environment=service", "--set", "ops.resume_every=5",
        "--set", "ops.max_restarts=50", "--set", "ops.breaker_restarts=50", "--set", "ops.preflight=off"]
ASYNC = ["--set", "schedule.mode=async", "--set", "rollout.engine=server", "--set", "buffer.policy=bound",
         "--set", "buffer.max_staleness=2", "--set", "schedule.log_rollouts=8"]
HOLDS = "resume_write:0.15,publish:0.03"  # widen the windows a kill is aimed at (not the trainer's work)


def start(work: Path, name: str, extra: list[str], faults: Path | None) -> Run:
    """A supervised run of the quickstart spec with BASE and `extra`; with `faults`, its fault points mark
    themselves there and hold a kill's windows open (HOLDS)."""
    env = {"FACTORY_FAULT_DIR": str(faults), "FACTORY_FAULT_HOLD_S": HOLDS} if faults is not None else None
    return Run.start(work, name, SPEC, [*BASE, *extra], env=env, faults=faults)


def strike(run: Run, target: str, moment: str, rng: random.Random, killed: list[int]) -> dict:
    """One kill: wait for an established attempt (alive, not one killed before, beating since the last kill),
    let a random 2-8 s pass, then SIGKILL the target at `moment` ('random', 'resume_write', 'publish')."""
    since = time.time()

    def established() -> bool:
        pid = run.attempt_pid()
        return pid is not None and pid not in killed and run.beat_at() > since
    if not wait_for(established, 300):
        return {"target": target, "moment": moment, "killed": False, "why": "no live attempt"}
    time.sleep(rng.uniform(2.0, 8.0))  # a random moment
    trainer = run.attempt_pid()
    if target != "trainer":  # a service the attempt is still starting (after a restart, say) is waited for
        wait_for(lambda: run.service(target) is not None or run.proc.poll() is not None, 60)
    pid = trainer if target == "trainer" else run.service(target)
    if pid is None or trainer is None:
        return {"target": target, "moment": moment, "killed": False, "why": f"no {target} process"}
    if moment != "random" and not run.at_point(moment, trainer):
        return {"target": target, "moment": moment, "killed": False, "why": f"never at {moment}"}
    step = run.step()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return {"target": target, "moment": moment, "killed": False, "why": "gone before the kill"}
    t_kill = time.monotonic()
    if target == "trainer":
        killed.append(pid)
    # Survived this kill: training gets past the step it had reached (a killed trainer redoes a few first).
    ok = wait_for(lambda: (run.step() > step and run.attempt_pid() not in (None, *killed))
                  or run.proc.poll() is not None, 300)
    return {"target": target, "moment": moment, "killed": True, "pid": pid, "step": step,
            "recovered": ok and run.proc.poll() in (None, 0), "until_progress_s": time.monotonic() - t_kill}


def weights_sha(home: Path, run_id: str) -> str:
    return hashlib.sha256((home / "checkpoints" / run_id / "final" / "model.safetensors").read_bytes()).hexdigest()


def prompt_counts(home: Path, run_dir: Path) -> tuple[int, int, int]:
    """(duplicated draws, skipped draws, draws trained) from `rollouts` (every group is logged)."""
    from factory.core.resume import latest

    by_draw: dict[int, set[int]] = {}
    for r in lake_rows(home, "rollouts"):
        by_draw.setdefault(r["draw"], set()).add(r["step"])
    dup = sum(1 for steps in by_draw.values() if len(steps) > 1)
    state, _ = latest(run_dir / "resume", log=lambda _: None)
    stream = state.loop["producer"]["stream"]
    left = set(stream["pending"])  # in flight or buffered when the run ended: not trained, not skipped
    skipped = [k for k in range(stream["next"]) if k not in by_draw and k not in left]
    return dup, len(skipped), len(by_draw)


def stalls(run_dir: Path) -> list[float]:
    path = run_dir / "saves.jsonl"
    return [json.loads(line)["stall_ms"] for line in path.read_text().splitlines()] if path.exists() else []


def chaos_run(work: Path, name: str, extra: list[str], plan: list[tuple[str, str]], rng: random.Random,
              steps: int) -> dict:
    run = start(work, name, ["--set", f"schedule.steps={steps}", *extra], work / f"{name}-faults")
    killed: list[int] = []
    kills = [strike(run, target, moment, rng, killed) for target, moment in plan if run.proc.poll() is None]
    rc = run.wait(timeout=1800)
    row = run.run_row()
    cuts = run.rows("interruptions")
    dup, missing = run.step_faults(steps)
    return {"name": name, "rc": rc, "status": row["status"], "run_id": row["run_id"], "kills": kills,
            "attempts": row["attempts"], "goodput": row["goodput"], "wall_s": row["wall_s"],
            "recover_s": [c["recover_s"] for c in cuts if c.get("recover_s") is not None],
            "detect_s": [c["detect_s"] for c in cuts], "steps_lost": [c["steps_lost"] for c in cuts],
            "duplicate_steps": dup, "missing_steps": missing, "stall_ms": stalls(run.run_dir()),
            "run_dir": str(run.run_dir())}


FAULTS = ("lake_outage", "disk_full", "supervisor_kill", "rank_kill", "reward_hacks")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer kills and steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-minutes", type=float, default=None, help="length of the goodput run (default 6; quick 3)")
    ap.add_argument("--long-every", type=float, default=None, help="seconds between trainer kills in the goodput run "
                                                                  "(default 120; quick 60)")
    ap.add_argument("--only", default=None, help="comma-separated parts to run: kills (the kill runs above) and/or "
                                                 f"{', '.join(FAULTS)} (default: all)")
    ap.add_argument("--isolation", choices=("bwrap", "none"), default="bwrap", help="sandbox of the reward hacks")
    args = ap.parse_args()
    parts = set(args.only.split(",")) if args.only else {"kills", *FAULTS}
    if unknown := parts - {"kills", *FAULTS}:
        ap.error(f"--only: unknown part(s) {sorted(unknown)}; expected kills or {', '.join(FAULTS)}")
    work = Path(tempfile.mkdtemp(prefix="factory-chaos-"))
    print(f"chaos: work in {work} (logs: {work}/*.log)", flush=True)
    result = kill_runs(args, work) if "kills" in parts else {}
    result.update(fault_runs(args, work, parts))
    result["quick"] = args.quick
    print(json.dumps(result))
    return 0


def kill_runs(args: argparse.Namespace, work: Path) -> dict:
    """The kill runs: reference, sync and async with kills, the goodput run; their table and JSON keys."""
    rng = random.Random(args.seed)
    quick = args.quick
    sync_steps, async_steps = (200, 150) if quick else (400, 300)
    long_min = args.long_minutes or (3.0 if quick else 6.0)
    long_every = args.long_every or (60.0 if quick else 120.0)

    # 0. The uninterrupted sync run the killed one must match, bit for bit.
    t0 = time.perf_counter()
    ref = start(work, "reference", ["--set", f"schedule.steps={sync_steps}", "--set", "name=sync"], None)
    assert ref.wait(timeout=1800) == 0, f"reference run failed: see {work}/reference.log"
    ref_row = ref.run_row()
    print(f"reference sync run: {time.perf_counter() - t0:.0f} s", flush=True)

    # 1. sync, killed: trainer and environment workers, some kills during a resume-point write.
    n_sync = 3 if quick else 5
    sync_plan = [(rng.choice(["trainer", "trainer", "env-worker"]), "random") for _ in range(n_sync - 1)]
    sync_plan.insert(rng.randrange(len(sync_plan) + 1), ("trainer", "resume_write"))
    sync = chaos_run(work, "sync", [], sync_plan, rng, sync_steps)
    sync["bit_identical"] = weights_sha(work / "sync", sync["run_id"]) == weights_sha(work / "reference",
                                                                                       ref_row["run_id"])
    print(f"sync chaos: {sum(k['killed'] for k in sync['kills'])} kills, status {sync['status']}", flush=True)

    # 2. async with the rollout server: all three targets, during writes and publishes too.
    n_async = 3 if quick else 5
    async_plan = [(rng.choice(["trainer", "rollout-server", "env-worker"]), "random") for _ in range(n_async - 2)]
    async_plan += [("trainer", "resume_write"), ("rollout-server", "publish")]
    rng.shuffle(async_plan)
    asy = chaos_run(work, "async", ASYNC, async_plan, rng, async_steps)
    asy["duplicate_prompts"], asy["skipped_prompts"], asy["draws_trained"] = prompt_counts(work / "async",
                                                                                          Path(asy["run_dir"]))
    print(f"async chaos: {sum(k['killed'] for k in asy['kills'])} kills, status {asy['status']}", flush=True)

    # 3. Goodput: a longer sync run, the trainer killed every `long_every` seconds.
    long = start(work, "long", ["--set", "schedule.steps=100000"], None)
    long_kills = []
    wait_for(lambda: long.step() > 0, 600)
    t_end = time.monotonic() + long_min * 60
    while time.monotonic() + long_every < t_end and long.proc.poll() is None:
        time.sleep(long_every)
        pid = long.attempt_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            long_kills.append(time.monotonic())
    wait_for(lambda: long.attempt_pid() is not None and long.step() > 0, 120)
    time.sleep(max(0.0, t_end - time.monotonic()))
    long.proc.send_signal(signal.SIGTERM)  # stop: saves a resume point and ends as interrupted
    long.wait(timeout=300)
    from factory.runs import recovery

    # The run was stopped on purpose at the end: its goodput over the time it ran, without that stop.
    cuts = [c for c in long.rows("interruptions") if c["cause"] != "signal"]
    lost = sum((c.get("redo_s") or 0) + (c.get("detect_s") or 0) + (c.get("recover_s") or 0) for c in cuts)
    long_goodput = recovery.goodput(long.run_row()["wall_s"], lost)
    long_steps = len(long.rows("steps"))

    # Report.
    all_kills = sync["kills"] + asy["kills"]
    killed = [k for k in all_kills if k["killed"]]
    recover = sync["recover_s"] + asy["recover_s"]
    stall = sync["stall_ms"] + asy["stall_ms"]
    survived = sum(1 for k in killed if k["recovered"]) if sync["status"] == asy["status"] == "succeeded" else 0
    rows = [("run", "kills", "attempts", "status", "dup/missing steps", "goodput", "recover s (p50)")]
    for r in (sync, asy):
        rows.append((r["name"], str(sum(k["killed"] for k in r["kills"])), str(r["attempts"]), r["status"],
                     f"{r['duplicate_steps']}/{r['missing_steps']}", f"{r['goodput']:.3f}",
                     f"{statistics.median(r['recover_s']):.2f}" if r["recover_s"] else "-"))
    rows.append(("long", str(len(long_kills)), "-", f"{long_steps} steps", "-", f"{long_goodput:.3f}", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    for k in all_kills:
        print(f"  kill {k['target']:<15} {k['moment']:<13} " + (
            f"step {k['step']:>4}  recovered={k['recovered']}  progress again after {k['until_progress_s']:.1f} s"
            if k["killed"] else f"not done: {k['why']}"))
    print(f"sync bit-identical to the uninterrupted run: {sync['bit_identical']}")
    print(f"async draws trained {asy['draws_trained']}, duplicated {asy['duplicate_prompts']}, "
          f"skipped {asy['skipped_prompts']}")
    print(f"goodput run: {long_min:g} min, trainer killed every {long_every:g} s ({len(long_kills)} kills)")
    return {
        "kills": len(killed), "survived": survived, "bit_identical_sync": sync["bit_identical"],
        "duplicate_steps": sync["duplicate_steps"] + asy["duplicate_steps"],
        "missing_steps": sync["missing_steps"] + asy["missing_steps"],
        "duplicate_prompts": asy["duplicate_prompts"], "skipped_prompts": asy["skipped_prompts"],
        "resume_s_p50": round(statistics.median(recover), 3) if recover else None,
        "resume_s_max": round(max(recover), 3) if recover else None,
        "detect_s_p50": round(statistics.median(sync["detect_s"] + asy["detect_s"]), 3),
        "goodput": round(long_goodput, 4), "goodput_kill_every_s": long_every, "goodput_kills": len(long_kills),
        "goodput_sync_chaos": round(sync["goodput"], 4), "goodput_async_chaos": round(asy["goodput"], 4),
        "save_stall_ms_p50": round(statistics.median(stall), 2) if stall else None,
        "save_stall_ms_max": round(max(stall), 2) if stall else None,
    }


def fault_runs(args: argparse.Namespace, work: Path, parts: set[str]) -> dict:
    """The dependency and supervision faults (`chaos_faults.py`), one run each: a table line per fault and one
    boolean JSON key each (`<fault>_survived`, or as named below), plus `faults` with what each saw."""
    from benchmarks import chaos_faults as cf

    steps = 12 if args.quick else 24
    scenarios = {
        "lake_outage": ("lake_outage_survived", lambda: cf.lake_outage(work, SPEC, BASE, steps)),
        "disk_full": ("disk_full_clean_stop", lambda: cf.disk_full(work, SPEC, BASE, steps)),
        "supervisor_kill": ("supervisor_kill_survived", lambda: cf.supervisor_kill(work, SPEC, BASE, steps)),
        "rank_kill": ("rank_kill_survived", lambda: cf.rank_kill(work, SPEC, BASE, steps)),
        "reward_hacks": ("reward_hacks_scored_zero", lambda: cf.reward_hacks(work, args.isolation)),
    }
    out: dict = {}
    seen: dict[str, dict] = {}
    for name in FAULTS:
        if name not in parts:
            continue
        key, scenario = scenarios[name]
        t0 = time.perf_counter()
        try:
            res = scenario()
        except Exception as e:  # a scenario that could not run is reported as failed, and the others still run
            res = {"fault": name, "ok": False, "why": f"{type(e).__name__}: {e}"}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        out[key], seen[name] = bool(res["ok"]), res
        print(f"fault {name:<16} {'held' if res['ok'] else 'FAILED: ' + str(res['why'])}  ({res['wall_s']:.0f} s)",
              flush=True)
    if seen:
        out["faults"] = seen
    return out


if __name__ == "__main__":
    sys.exit(main())
