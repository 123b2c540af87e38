"""The whole experiment in one call, as the quickstart job runs it: dataset, SFT warm start, the RL run
(supervised in child processes, or in this process), the control, the eval report; and one sweep member end to
end. What `factory run` runs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from factory.cockpit.sweep_search import TrialReporter
from factory.cockpit.tracking import Tracker
from factory.config import ExperimentSpec
from factory.core.loop import RunInterrupted
from factory.envs.spec_check import check_spec
from factory.home import FactoryPaths
from factory.lake.results import run_outcome
from factory.lake.writer import Lake
from factory.models.checkpoint import load_checkpoint
from factory.runs.attempt import write_launch
from factory.runs.degraded import read_when_up
from factory.runs.recovery import now, run_row
from factory.runs.restarts import supervise
from factory.runs.rl_run import new_run_id, run_rl
from factory.runs.run_result import RunResult, finished_result
from factory.runs.stages import (
    Log,
    ProgressCallback,
    build_dataset,
    cached_sft_checkpoint,
    eval_summary,
    load_dataset,
    render_report,
    run_sft_control,
    train_sft_checkpoint,
)


@dataclass(frozen=True)
class Pruned:
    """A sweep member whose trial was pruned: its run stopped at a resume point (resumable) for `reason`."""
    run_id: str
    reason: str


def run_sweep_member(spec: ExperimentSpec, paths: FactoryPaths, lake: Lake, tracker: Tracker, sweep_id: str,
                     member: str, axes: dict, sweep_name: str, mlflow_parent_run_id: str | None = None,
                     log: Log = print, progress: ProgressCallback | None = None, run_id: str | None = None,
                     trial: TrialReporter | None = None) -> RunResult | Pruned:
    """One sweep member end to end (dataset, shared SFT warm start, RL run, evals), its `sweeps` row kept current.

    A tpe sweep's member has its `trial`: its periodic evals are reported to it, and when its pruner says so the
    run stops at a resume point, the trial is told it was pruned and the member's row says `pruned` with the
    reason (returned as `Pruned`); a member that finishes tells the trial its final held-out accuracy."""
    created = now()
    run_id = run_id or new_run_id(spec)
    row = dict(sweep_id=sweep_id, member=member, name=sweep_name, axes=json.dumps(axes, sort_keys=True),
               spec=spec.to_json(), mlflow_parent_run_id=mlflow_parent_run_id, created_at=created)
    # the run id from the start: the live sweep page (factory/cockpit/sweep_live.py) finds its steps while it trains
    lake.upsert("sweeps", [dict(row, status="running", run_id=run_id, recorded_at=now())])
    try:
        splits = load_dataset(build_dataset(spec, paths).path)
        sft = cached_sft_checkpoint(spec, paths, splits, log=log, progress=progress)
        res = run_rl(spec, paths, sft.checkpoint.path, splits, lake, tracker, log=log, sweep_id=sweep_id,
                     run_id=run_id, mlflow_experiment=sweep_name, mlflow_parent_run_id=mlflow_parent_run_id,
                     progress=progress,  # a periodic eval is of the whole held-out split: its n
                     on_eval=trial.report if trial is not None else None)
    except RunInterrupted:
        if trial is None or trial.reason is None:  # stopped at a resume point (its run `interrupted`): resumable
            lake.upsert("sweeps", [dict(row, status="interrupted", recorded_at=now())])
            raise
        trial.pruned()
        lake.upsert("sweeps", [dict(row, status="pruned", run_id=run_id, reason=trial.reason, recorded_at=now())])
        log(f"sweep member {member}: pruned ({trial.reason}); run {run_id} can be resumed")
        return Pruned(run_id, trial.reason)
    except BaseException:
        lake.upsert("sweeps", [dict(row, status=_stopped_as(lake, run_id), recorded_at=now())])
        raise
    result = run_outcome(lake, res.run_id).accuracy  # the run's result, as lake/results.py defines it
    final = res.final_accuracy if result is None else result
    if trial is not None:
        trial.complete(final)
    lake.upsert("sweeps", [dict(row, status="succeeded", run_id=res.run_id, final_accuracy=final, recorded_at=now())])
    return res


def _stopped_as(lake: Lake, run_id: str) -> str:
    """A member's `sweeps` status after its run raised: its run's own (`interrupted`: a crash at a resume point, which
    a retry resumes; `failed`: stopped for good), else `failed` (it broke before its run was recorded)."""
    try:
        found = run_row(lake, run_id)
    except Exception:  # the lake is down too: what we know is that it stopped
        return "failed"
    return found["status"] if found and found["status"] in ("interrupted", "failed") else "failed"


def run_experiment(spec: ExperimentSpec, paths: FactoryPaths, control: bool = False, log: Log = print,
                   supervised: bool = False) -> dict:
    """Every stage in order, as the quickstart job runs them; returns the eval summary + report.

    `supervised`: the RL run's attempts run in child processes that are restarted (resuming) when one
    dies or hangs (`runs/restarts.py`); a run that does not succeed raises `RunFailed` with its exit code.
    A spec built in Python gets the task checks a loaded one got (`check_spec`: task size, prompt length).
    The lake reads after the run (its row, the evals of the report) wait out a catalog outage of up to
    ops.lake_outage_s, as the run's own reads do: a run that rode through a catalog restart still reports."""
    check_spec(spec)
    ds = build_dataset(spec, paths)
    splits = load_dataset(ds.path)
    log(f"dataset {ds.fingerprint}: {ds.n_train} train / {ds.n_eval} held-out")
    sft = train_sft_checkpoint(spec, paths, splits, log=log)
    lake, tracker = Lake.open(paths), Tracker(paths)
    if supervised:
        run_id = new_run_id(spec)
        write_launch(paths.checkpoints / run_id, spec, sft.checkpoint.path)
        rc = supervise(paths, run_id, spec, log=log)
        if rc != 0:
            raise RunFailed(run_id, rc)
        seconds = read_when_up(lambda: run_row(lake, run_id)["wall_s"], spec.ops.lake_outage_s, log)
    else:
        run = run_rl(spec, paths, sft.checkpoint.path, splits, lake, tracker, log=log)
        run_id, seconds = run.run_id, run.seconds
    if control:
        model, tok = load_checkpoint(sft.checkpoint.path)
        run_sft_control(spec, paths, splits, lake, run_id, spec.schedule.steps, model, tok, seconds=seconds,
                        sft_seconds_per_step=sft.seconds / max(1, sft.steps), log=log)
    return report_when_up(lake, run_id, spec.ops.lake_outage_s, log)


def report_when_up(lake: Lake, run_id: str, budget_s: float, log: Log = print, *,
                   sleep: Callable[[float], None] = time.sleep) -> dict:
    """The eval summary of finished run `run_id` with its rendered `report`, read once the lake answers (an outage
    of up to `budget_s` is waited out; `sleep` is the wait between tries)."""
    summary = read_when_up(lambda: eval_summary(lake, run_id), budget_s, log, sleep=sleep)
    summary["report"] = render_report(summary)
    return summary


def run_rl_supervised(spec: ExperimentSpec, paths: FactoryPaths, init_checkpoint: str, run_id: str, lake: Lake,
                      log: Log = print) -> RunResult:
    """The RL run `run_id` (new, or continued from its newest resume point) in supervised child processes: what a
    caller that is not itself a rank runs for a data-parallel spec (each attempt a torchrun group of ranks,
    runs/rank_group.py), e.g. the `grpo_run` asset in the Dagster process. `RunFailed` if it does not succeed."""
    write_launch(paths.checkpoints / run_id, spec, init_checkpoint)  # read only until the run has its row
    rc = supervise(paths, run_id, spec, log=log)
    if rc != 0:
        raise RunFailed(run_id, rc)
    return finished_result(lake, run_id)


class RunFailed(RuntimeError):
    """A supervised run that did not succeed; `code` is the exit code `factory run` returns."""

    def __init__(self, run_id: str, code: int):
        super().__init__(f"run {run_id} did not succeed (exit code {code}); see `factory runs` and the "
                         f"interruptions table; resume it with: factory resume {run_id}")
        self.run_id, self.code = run_id, code
