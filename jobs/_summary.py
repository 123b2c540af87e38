"""When a sweep's summary is due, which version of it, and why not when it is not.

A sweep is summarized as soon as every member has ended, whatever evals of its checkpoints are still owed (the
summary says which: `pending_evals`), and again each time the set of its evals done changes, until a summary drawn
with none pending. A version is that set (`assets/_pending.py` `EvalProgress.version`), carried by the summary run
as a tag, so the instance itself records which versions were requested: nothing is lost with a sensor's cursor.

Summaries have a queue of their own (`factory/queue: summary`, one at a time; jobs/_queue.py), so the first one
does not wait for a model eval that is running, and evals never wait for a summary. Where several sweeps are due,
their first and complete summaries go before summaries in between (some evals landed, some still owed); a summary in
between also waits until none of the sweep's owed evals is left to start, so it is not redrawn after every eval.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dagster import DagsterInstance, DagsterRun, RunsFilter

from assets._pending import EvalProgress, progress
from factory.cockpit.sweep import MEMBER_TAG, SWEEP_TAG, read_sweep
from factory.home import FactoryPaths
from jobs._queue import IN_FLIGHT, holds_slot, owed_evals

SUMMARY_JOB = "sweep_summary_job"
VERSION_TAG = "factory/evals_done"  # the version a summary run draws: a digest of the sweep's evals done
PENDING_TAG = "factory/evals_pending"  # how many of its evals were still owed when it was requested
ENDED = ("succeeded", "failed", "refused", "pruned")  # a member's `sweeps` status once it has ended


@dataclass(frozen=True)
class SummaryState:
    """One sweep's summary: whether one is due now (`due`), ahead of evals (`ahead`), and the reason in words."""

    sweep_id: str
    reason: str
    due: bool = False
    ahead: bool = False  # the first summary or the complete one: it goes before summaries in between
    final: bool = False  # a summary with no eval pending was requested: nothing more to do for this sweep
    progress: EvalProgress | None = None


def sweep_ids(paths: FactoryPaths) -> list[str]:
    root = paths.root / "sweeps"
    return sorted(p.name for p in root.iterdir() if (p / "sweep.json").is_file()) if root.is_dir() else []


def summary_states(instance: DagsterInstance, paths: FactoryPaths, lake, eval_job: str,
                   skip: set[str] | frozenset[str] = frozenset()) -> list[SummaryState]:
    """The summary state of every sweep under `paths` but those in `skip`; `lake` is a `factory.lake.Lake`."""
    ids = [s for s in sweep_ids(paths) if s not in skip]
    if not ids:
        return []
    runs: dict[str, list[DagsterRun]] = defaultdict(list)
    for r in instance.get_runs(RunsFilter(job_name=SUMMARY_JOB)):
        runs[r.tags.get(SWEEP_TAG, "")].append(r)
    rows = lake.read("sweeps").select(["sweep_id", "member", "status", "run_id"]).to_pylist()
    states = []
    for s in ids:
        try:
            states.append(_state(instance, paths, lake, eval_job, s, [r for r in rows if r["sweep_id"] == s], runs[s]))
        except (OSError, ValueError, KeyError) as e:  # one broken sweep directory holds back neither others nor evals
            states.append(SummaryState(s, f"sweep {s}: its sweep.json cannot be read ({type(e).__name__}: {e})"))
    return states


def _resuming(instance: DagsterInstance, member: str) -> bool:
    """Whether an interrupted member (its run worker killed: stopped at a resume point) has a Dagster run queued,
    running or awaiting its automatic retry, which resumes it; if not, it has ended interrupted."""
    return any(holds_slot(instance, r) for r in instance.get_runs(RunsFilter(tags={MEMBER_TAG: member})))


def _state(instance: DagsterInstance, paths: FactoryPaths, lake, eval_job: str, sweep_id: str, rows: list[dict],
           runs: list[DagsterRun]) -> SummaryState:
    # (a summary run without a version was requested before versions existed, once every eval was done or waited for)
    if any(r.tags.get(PENDING_TAG) == "0" or VERSION_TAG not in r.tags for r in runs):
        return SummaryState(sweep_id, f"sweep {sweep_id}: summarized with every eval", final=True)
    info = read_sweep(paths, sweep_id)
    defn = info["definition"]
    if defn.get("mode") == "tpe" and not info.get("search_done"):
        return SummaryState(sweep_id, f"sweep {sweep_id}: {len(info['members'])} of {defn['trials']} trials asked")
    n = len(info["members"])
    resuming = sum(r["status"] == "interrupted" and _resuming(instance, r["member"]) for r in rows)
    ended = sum(r["status"] in ENDED or r["status"] == "interrupted" for r in rows) - resuming
    if ended < n or len(rows) < n:
        running = sum(r["status"] == "running" for r in rows)
        again = f", {resuming} interrupted, which Dagster's retry resumes" if resuming else ""
        what = ("still running" if running == n - ended else
                f"not ended ({running} running, {n - ended - running - resuming} queued{again})")
        return SummaryState(sweep_id, f"sweep {sweep_id}: {n - ended} of {n} members {what}")
    prog = progress(instance, lake, {r["run_id"] for r in rows if r["run_id"]})
    pending = f"{len(prog.pending)} eval(s) pending" if prog.pending else "no eval pending"
    if any(r.tags.get(VERSION_TAG) == prog.version for r in runs):
        return SummaryState(sweep_id, f"sweep {sweep_id}: summary up to date ({pending})", progress=prog)
    if any(r.status in IN_FLIGHT for r in runs):
        return SummaryState(sweep_id, f"sweep {sweep_id}: a summary is being drawn; the next one ({pending}) "
                            "follows when it ends", progress=prog)
    if not runs or not prog.pending:  # the first summary, or the complete one: ahead of those in between
        return SummaryState(sweep_id, f"sweep {sweep_id}: summary due, {pending}", due=True, ahead=True,
                            progress=prog)
    unstarted = sum(not e.attempted for e in owed_evals(instance, lake, eval_job,
                                                        {r["run_id"] for r in rows if r["run_id"]}))
    if unstarted:
        return SummaryState(sweep_id, f"sweep {sweep_id}: the summary is drawn again once its {unstarted} owed "
                            f"eval(s) not started yet have started ({pending})", progress=prog)
    return SummaryState(sweep_id, f"sweep {sweep_id}: summary due again, {pending}", due=True, progress=prog)


__all__ = ["ENDED", "PENDING_TAG", "SUMMARY_JOB", "VERSION_TAG", "SummaryState", "summary_states", "sweep_ids"]
