"""The launcher's side of a tpe sweep: asking the study for trials as the sweep's slots free up.

Each tick, a tpe sweep with room under `max_concurrent` (counting its runs in flight and the members asked but not
launched yet) and fewer than `trials` trials asked gets new trials; each becomes a member (spec stored, partition
added, `sweeps` row queued) that the launcher then starts like a grid sweep's member. Asking is idempotent across
ticks: a member is stored before its run is requested, and the run key is the member key, so a tick that dies
between the two leaves a member the next tick launches, never a second run.

TPE learns only from results, so a trial is asked only once every started member whose runs have all ended (none
queued, running or awaiting Dagster's retry) has its result in the study. A member that died without telling it (its
run failed for good, e.g. its retries spent) has its trial told here: its result from its `sweeps` row when it has
one, else FAIL.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from dagster import SensorEvaluationContext

from assets.sweeps import sweep_members, warm_starts
from factory.cockpit.sweep import (
    SweepDefinition,
    SweepError,
    add_member,
    member_key,
    trial_member,
    update_sweep,
    write_warm_start_spec,
)
from factory.cockpit.sweep_search import ask
from factory.home import FactoryPaths
from resources import LakeResource, MlflowResource
from resources.study import sweep_study


def ask_trials(context: SensorEvaluationContext, paths: FactoryPaths, lake: LakeResource, mlflow: MlflowResource,
               info: dict[str, Any], started: set[str], holding: set[str], limit: int) -> dict[str, Any]:
    """New trials for the tpe sweep `info` as far as its limit (`limit` members or warm starts holding a slot; those
    holding one now are `holding`) allows; returns the sweep as stored after them (`search_done` set once every
    trial was asked)."""
    import optuna  # noqa: PLC0415 heavy: optuna; when the sensor asks for trials

    defn, sweep_id = info["definition"], info["sweep_id"]
    if info.get("search_done"):
        return info
    waiting = sum(m["key"] not in started for m in info["members"])
    room = limit - len(holding) - waiting
    if room <= 0:
        return info
    study = sweep_study(context.instance, paths, info)
    _settle(context, lake, study, info, started - holding)
    asked = len(study.get_trials(deepcopy=False))
    space = SweepDefinition(**defn).space
    before = len(info["members"])
    for _ in range(min(room, defn["trials"] - asked)):
        trial = ask(study, space, member_of=lambda n, params: member_key(sweep_id, n, params))
        try:
            member = trial_member(paths, sweep_id, trial.number, trial.params)
        except SweepError as e:  # parameters valid alone, not together: the trial fails, the next one is asked
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            context.log.warning(f"sweep {sweep_id}: {e.one_line()}")
            continue
        write_warm_start_spec(paths, member.warm_start, member.spec)
        context.instance.add_dynamic_partitions(warm_starts.name, [member.warm_start])
        context.instance.add_dynamic_partitions(sweep_members.name, [member.key])
        now = datetime.now(UTC)
        with lake.lake() as lk:
            lk.upsert("sweeps", [dict(sweep_id=sweep_id, member=member.key, name=defn["name"],
                                      axes=json.dumps(member.values, sort_keys=True), spec=member.spec.to_json(),
                                      status="queued", mlflow_parent_run_id=info.get("mlflow_parent_run_id"),
                                      created_at=now, recorded_at=now)])
        info = add_member(paths, sweep_id, member, trial=trial.number, trial_id=trial.trial_id)
        context.log.info(f"sweep {sweep_id}: trial {trial.number} -> {member.key} {trial.params}")
    if len(info["members"]) > before and info.get("mlflow_parent_run_id"):  # the parent counts its members
        mlflow.tracker().set_tags(info["mlflow_parent_run_id"], {"factory.members": len(info["members"])})
    if len(study.get_trials(deepcopy=False)) >= defn["trials"]:
        info = dict(info, search_done=True)
        update_sweep(paths, sweep_id, info)
    return info


def _settle(context: SensorEvaluationContext, lake: LakeResource, study: Any, info: dict[str, Any],
            ended: set[str]) -> None:
    """Tell the study the result of each trial still running whose member is in `ended` (started, and none of its
    runs queued, running or awaiting a retry): what its `sweeps` row says, else FAIL."""
    import optuna  # noqa: PLC0415 heavy: optuna; when the sensor asks for trials

    running = {t.number for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
    stale = [m for m in info["members"] if m.get("trial") in running and m["key"] in ended]
    if not stale:
        return
    with lake.lake() as lk:
        rows = {r["member"]: r for r in lk.read("sweeps", f"sweep_id = '{info['sweep_id']}'").select(
            ["member", "status", "final_accuracy"]).to_pylist()}
    for m in stale:
        row = rows.get(m["key"], {})
        if row.get("status") == "succeeded" and row.get("final_accuracy") is not None:
            study.tell(m["trial"], row["final_accuracy"])
            told = f"its result {row['final_accuracy']:.3f}"
        elif row.get("status") == "pruned":
            study.tell(m["trial"], state=optuna.trial.TrialState.PRUNED)
            told = "PRUNED"
        else:
            study.tell(m["trial"], state=optuna.trial.TrialState.FAIL)
            told = "FAIL"
        context.log.warning(f"sweep {info['sweep_id']}: trial {m['trial']} ({m['key']}): its runs ended without "
                            f"telling the study (member {row.get('status', 'without a row')}); told it {told}")
