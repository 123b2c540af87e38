"""The whole experiment in one call, as `factory run` runs it: dataset, SFT warm start, the RL run, the control, the
eval report; and one sweep member end to end. Both are the `Pipeline` of runs/pipeline.py, the assembly the Dagster
assets use too, with the supervision their caller asks for."""

from __future__ import annotations

import json
from dataclasses import dataclass

from factory.cockpit.sweep_search import TrialReporter
from factory.cockpit.tracking import Tracker
from factory.config import ExperimentSpec
from factory.core.loop import RunInterrupted
from factory.envs.spec_check import check_spec
from factory.home import FactoryPaths
from factory.lake.results import run_outcome
from factory.lake.writer import Lake
from factory.runs.pipeline import Filing, Pipeline, RunFailed, Supervision, report_when_up
from factory.runs.recovery import now, run_row
from factory.runs.rl_run import new_run_id
from factory.runs.run_result import RunResult
from factory.runs.stages import Log, ProgressCallback

__all__ = ["Pruned", "RunFailed", "report_when_up", "run_experiment", "run_sweep_member"]


@dataclass(frozen=True)
class Pruned:
    """A sweep member whose trial was pruned: its run stopped at a resume point (resumable) for `reason`."""
    run_id: str
    reason: str


def run_sweep_member(spec: ExperimentSpec, paths: FactoryPaths, lake: Lake, tracker: Tracker, sweep_id: str,
                     member: str, axes: dict, sweep_name: str, mlflow_parent_run_id: str | None = None,
                     log: Log = print, progress: ProgressCallback | None = None, run_id: str | None = None,
                     trial: TrialReporter | None = None,
                     supervision: Supervision = Supervision.IN_PROCESS) -> RunResult | Pruned:
    """One sweep member end to end (dataset, shared SFT warm start, RL run, evals), its `sweeps` row kept current;
    the RL run supervised as `supervision` says (the launcher resource's choice, `Pipeline.train`).

    A tpe sweep's member has its `trial`: its periodic evals are reported to it, and when its pruner says so the
    run stops at a resume point, the trial is told it was pruned and the member's row says `pruned` with the
    reason (returned as `Pruned`); a member that finishes tells the trial its final held-out accuracy."""
    created = now()
    run_id = run_id or new_run_id(spec)
    row = dict(sweep_id=sweep_id, member=member, name=sweep_name, axes=json.dumps(axes, sort_keys=True),
               spec=spec.to_json(), mlflow_parent_run_id=mlflow_parent_run_id, created_at=created)
    # the run id from the start: the live sweep page (factory/cockpit/sweep_live.py) finds its steps while it trains
    lake.upsert("sweeps", [dict(row, status="running", run_id=run_id, recorded_at=now())])
    pipeline = Pipeline(spec, paths, log=log, progress=progress)
    try:
        splits = pipeline.dataset()[1]
        sft = pipeline.warm_start(splits, shared=True)
        res = pipeline.train(sft.checkpoint.path, splits, lake, tracker, supervision, run_id=run_id,
                             filing=Filing(sweep_id, sweep_name, mlflow_parent_run_id),
                             # a periodic eval is of the whole held-out split: its n
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
    """Every stage in order (`Pipeline`), as `factory run` runs them; returns the eval summary + report.

    `supervised`: the RL run's attempts run in child processes that are restarted (resuming) when one
    dies or hangs (`runs/restarts.py`); a run that does not succeed raises `RunFailed` with its exit code.
    A spec built in Python gets the task checks a loaded one got (`check_spec`: task size, prompt length).
    The lake reads after the run (its row, the evals of the report) wait out a catalog outage of up to
    ops.lake_outage_s, as the run's own reads do: a run that rode through a catalog restart still reports."""
    check_spec(spec)
    pipeline = Pipeline(spec, paths, log=log)
    ds, splits = pipeline.dataset()
    log(f"dataset {ds.fingerprint}: {ds.n_train} train / {ds.n_eval} held-out")
    sft = pipeline.warm_start(splits, shared=False)
    lake, tracker = Lake.open(paths), Tracker(paths)
    run = pipeline.train(sft.checkpoint.path, splits, lake, tracker,
                         Supervision.SUPERVISED if supervised else Supervision.IN_PROCESS)
    if control:
        pipeline.control(splits, lake, sft.checkpoint.path, sft.seconds / max(1, sft.steps), run.run_id, run.seconds)
    return pipeline.report(lake, run.run_id)
