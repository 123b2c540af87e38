"""The dependency and supervision faults of `benchmarks/chaos.py`: each a real supervised `factory run` of the tiny
model on its own FACTORY_HOME, struck once, then checked from the lake, the run directory and /proc.

- `lake_outage`: the SQLite catalog's write lock held by this process from step 2 (every other connection gets
  `database is locked`, a real outage) until the run has spooled rows and trained 4 more steps, shorter than
  `ops.lake_outage_s`: the run must finish `succeeded` with every `steps` row once.
- `disk_full`: ENOSPC at the second resume-point write (`FACTORY_FAULT_ENOSPC`, `infra/faults.py`: a small
  filesystem needs root to mount): the run must stop with "disk full: DIR", exit `EXIT_DISK_FULL`, 0 restarts,
  the previous resume point intact; then `factory resume` finishes it with every step once.
- `supervisor_kill`: SIGKILL of the `factory run` process once a resume point exists: its attempt must stop at its
  next resume point (cause `supervisor_lost`), no process of the run may be left alive afterwards (/proc), and
  `factory resume` finishes it with every step once.
- `rank_kill`: a 2-rank data-parallel run (trainer.world_size=2, gloo): SIGKILL of rank 1 once a resume point
  exists; the supervisor must restart the group and the run finish `succeeded` with every step once.
- `reward_hacks`: the red-team reward hacks (`envs/reward_hacks.py`, as `python -m factory.envs.redteam` runs
  them): every hack must score 0 and the honest control 1; and what one execution can leave for a later one
  (`envs/redteam_carryover.py`: secrets in every namespace, the HumanEval/0 answer table on pools of one and four,
  300 MB left in shared memory): every case contained.

Each returns a dict with `ok` (whether the fault was survived as specified) and what it saw; `why` names the first
check that failed.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.chaos_runs import LIMIT_S, ROOT, Run, alive, descendants, proc_table, wait_for
from factory.core.resume import verify
from factory.home import FactoryPaths
from factory.lake.spool import SPOOL
from factory.runs.attempt import AttemptLock
from factory.runs.exit_codes import EXIT_DISK_FULL

RESUME_EVERY = 3  # resume points every 3 steps: each fault lands after the first one
# resume_write is reached after each of a resume point's 4 files: the 5th time is the second point's first file.
SECOND_RESUME_WRITE = "resume_write:5"


def _verdict(res: dict, checks: list[tuple[bool, str]]) -> dict:
    """`res` with ok (every check held) and why (the first that did not)."""
    failed = [what for held, what in checks if not held]
    return {**res, "ok": not failed, "why": failed[0] if failed else None}


def _finished(run: Run, res: dict, steps: int) -> list[tuple[bool, str]]:
    """Record the run's end in `res`; the checks that it succeeded with every step once."""
    row = run.run_row()
    dup, missing = run.step_faults(steps)
    res.update(status=row["status"], attempts=row["attempts"], duplicate_steps=dup, missing_steps=missing)
    return [(row["status"] == "succeeded", f"run ended {row['status']}"),
            (dup == 0 and missing == 0, f"{dup} duplicate / {missing} missing steps")]


def lake_outage(work: Path, spec: Path, base: list[str], steps: int, budget_s: float = 300.0) -> dict:
    """A catalog outage from step 2, held until rows were spooled and 4 more steps trained (under `budget_s`,
    ops.lake_outage_s, set explicitly so the outage is inside it)."""
    run = Run.start(work, "lake-outage", spec, [*base, "--set", f"schedule.steps={steps}", "--set",
                                                f"ops.resume_every={RESUME_EVERY}", "--set",
                                                f"ops.lake_outage_s={budget_s:g}"])
    res: dict = {"fault": "lake_outage"}
    wait_for(lambda: run.reached(2), LIMIT_S)
    if run.proc.poll() is not None:
        return _verdict(res, [(False, f"run ended before step 2 (rc {run.proc.returncode})")])
    conn = sqlite3.connect(FactoryPaths(run.home).catalog_db, isolation_level=None, timeout=60)
    conn.execute("BEGIN EXCLUSIVE")  # every other connection now gets `database is locked`
    t0, from_step, spooled = time.monotonic(), run.step(), 0

    def outage_done() -> bool:
        nonlocal spooled
        d = run.run_dir()
        spooled = max(spooled, len(list((d / SPOOL).glob("*.json"))) if d else 0)
        # Half the budget at most: the run must ride it out, not stop at a resume point past it.
        return (spooled > 0 and run.step() >= from_step + 4) or run.proc.poll() is not None
    try:
        wait_for(outage_done, budget_s / 2)
    finally:
        conn.execute("ROLLBACK")
        conn.close()
    res.update(outage_s=round(time.monotonic() - t0, 1), outage_from_step=from_step, outage_to_step=run.step(),
               spooled_files_max=spooled)
    res["rc"] = run.wait()
    checks = [(res["rc"] == 0, f"factory run exited {res['rc']}"),
              (spooled > 0, "nothing was spooled: the outage did not touch the run")]
    return _verdict(res, checks + _finished(run, res, steps))


def disk_full(work: Path, spec: Path, base: list[str], steps: int) -> dict:
    """ENOSPC at the second resume-point write; then `factory resume` with the fault gone (space freed)."""
    run = Run.start(work, "disk-full", spec, [*base, "--set", f"schedule.steps={steps}", "--set",
                                              f"ops.resume_every={RESUME_EVERY}"],
                    env={"FACTORY_FAULT_ENOSPC": SECOND_RESUME_WRITE})
    res: dict = {"fault": "disk_full", "rc": run.wait()}
    row = run.run_row()
    resume = run.home / "checkpoints" / row["run_id"] / "resume"
    kept = sorted(p.name for p in resume.iterdir()) if resume.is_dir() else []
    first = f"step-{RESUME_EVERY:06d}"
    log = run.log()
    res.update(status_stopped=row["status"], restarts=row["restarts"], resume_points_kept=kept,
               said_disk_full=f"disk full: {resume}" in log)
    checks = [(res["rc"] == EXIT_DISK_FULL, f"factory run exited {res['rc']}, not {EXIT_DISK_FULL} (disk full)"),
              (res["said_disk_full"], f"no 'disk full: {resume}' line"),
              ("Traceback" not in log, "a traceback"),
              ("restart 1 of" not in log and row["restarts"] == 0 and row["attempts"] == 1, "a restart was spent"),
              (row["status"] == "interrupted", f"stopped run is {row['status']}, not interrupted"),
              (kept == [first] and verify(resume / first) is None, f"previous resume point not intact: {kept}")]
    res["resume_rc"] = run.resume(row["run_id"])
    checks.append((res["resume_rc"] == 0, f"factory resume exited {res['resume_rc']}"))
    return _verdict(res, checks + _finished(run, res, steps))


def supervisor_kill(work: Path, spec: Path, base: list[str], steps: int) -> dict:
    """SIGKILL of the supervising `factory run` after step 4 (a resume point at 3 exists); the attempt must stop
    by itself at its next resume point and leave nothing running; then `factory resume`."""
    run = Run.start(work, "supervisor-kill", spec, [*base, "--set", f"schedule.steps={steps}", "--set",
                                                    f"ops.resume_every={RESUME_EVERY}"])
    res: dict = {"fault": "supervisor_kill"}
    wait_for(lambda: run.reached(RESUME_EVERY + 1) and run.attempt_pid() is not None, LIMIT_S)
    attempt = run.attempt_pid()
    if run.proc.poll() is not None or attempt is None:
        return _verdict(res, [(False, f"run ended before step {RESUME_EVERY + 1} (rc {run.proc.returncode})")])
    family = descendants(run.proc.pid)  # the attempt, its warm standby, its environment workers
    killed_at, res["killed_at_step"] = time.monotonic(), run.step()
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait()
    run_dir = run.run_dir()
    stopped = wait_for(lambda: not alive(attempt) and not AttemptLock.is_held(run_dir), LIMIT_S)
    res["attempt_stopped_s"] = round(time.monotonic() - killed_at, 2)
    # Whatever the dead supervisor started must end with its attempt (the standby sees EOF on its stdin, the
    # workers' parent is gone): give them the time a clean exit takes, then list any still running.
    home = str(run.home)
    wait_for(lambda: not any(alive(p) for p in family), 120)
    left = sorted({p for p in family if alive(p)} | {p for p, (_, cmd) in proc_table().items() if home in cmd})
    res["left_running"] = left
    for pid in left:  # ours: do not leave them behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    row = run.run_row()
    cuts = run.rows("interruptions")
    res.update(status_stopped=row["status"], causes=[c["cause"] for c in cuts],
               stopped_at_step=max((r["step"] for r in run.rows("steps")), default=0))
    checks = [(stopped, "the orphaned attempt never stopped"),
              (not left, f"processes left running unwatched: {left}"),
              (row["status"] == "interrupted" and res["causes"] == ["supervisor_lost"],
               f"stopped as {row['status']} / {res['causes']}, not interrupted / supervisor_lost")]
    res["resume_rc"] = run.resume(row["run_id"])
    checks.append((res["resume_rc"] == 0, f"factory resume exited {res['resume_rc']}"))
    return _verdict(res, checks + _finished(run, res, steps))


def rank_kill(work: Path, spec: Path, base: list[str], steps: int) -> dict:
    """A 2-rank data-parallel run; SIGKILL of rank 1 after step 4 (a resume point at 3 exists)."""
    run = Run.start(work, "rank-kill", spec, [*base, "--set", f"schedule.steps={steps}", "--set",
                                              f"ops.resume_every={RESUME_EVERY}", "--set", "trainer.world_size=2",
                                              "--set", "trainer.strategy=ddp"])
    res: dict = {"fault": "rank_kill"}
    wait_for(lambda: run.reached(RESUME_EVERY + 1) and run.attempt_pid() is not None, LIMIT_S)
    rank0 = run.attempt_pid()
    if run.proc.poll() is not None or rank0 is None:
        return _verdict(res, [(False, f"run ended before step {RESUME_EVERY + 1} (rc {run.proc.returncode}); "
                                      f"see {run.log_path}")])
    table = proc_table()
    launcher = table.get(rank0, (0, ""))[0]  # torchrun: the ranks are its children
    others = [p for p, (ppid, cmd) in table.items() if ppid == launcher and p != rank0 and " attempt " in cmd]
    if not others:
        run.proc.send_signal(signal.SIGTERM)
        run.wait()
        return _verdict(res, [(False, "no second rank found (the attempt is not a rank group)")])
    res["killed_at_step"] = run.step()
    os.kill(others[0], signal.SIGKILL)
    res["rc"] = run.wait()
    res["restarted"] = "restart 1 of" in run.log()
    checks = [(res["rc"] == 0, f"factory run exited {res['rc']}"),
              (res["restarted"], "the group was not restarted")]
    return _verdict(res, checks + _finished(run, res, steps))


def reward_hacks(work: Path, isolation: str = "bwrap") -> dict:
    """The red-team reward hacks in their own process (as `python -m factory.envs.redteam` runs them)."""
    code = ("import json; from factory.envs.redteam import run_reward_hack_cases, print_reward_hacks; "
            "from factory.envs.redteam_carryover import print_carryover, run_carryover; "
            f"summary = print_reward_hacks(*run_reward_hack_cases({isolation!r}, 2)); "
            f"carried, summary['carryover'] = run_carryover({isolation!r}); print_carryover(carried); "
            "print(json.dumps(summary))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=LIMIT_S)
    (work / "reward-hacks.log").write_text(out.stdout + out.stderr)
    res: dict = {"fault": "reward_hacks", "rc": out.returncode, "isolation": isolation}
    try:
        summary = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return _verdict(res, [(False, f"no summary line (rc {out.returncode}); see {work}/reward-hacks.log")])
    res.update(summary)
    carry = summary["carryover"]
    return _verdict(res, [(summary["cases"] > 0 and summary["scored_zero"] == summary["cases"],
                           f"{summary['cases'] - summary['scored_zero']} of {summary['cases']} hacks scored > 0"),
                          (summary["honest_control"] is True, "the honest control did not score 1"),
                          (carry["cases"] > 0 and carry["contained"] == carry["cases"],
                           f"{carry['cases'] - carry['contained']} of {carry['cases']} carry-over cases escaped")])
