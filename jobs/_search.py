"""The launcher's side of a tpe sweep: asking the study for trials as the sweep's slots free up.

Each tick, a tpe sweep with room under `max_concurrent` (counting its runs in flight and the members asked but not
launched yet) and fewer than `trials` trials asked gets new trials; each becomes a member (spec stored, partition
added, `sweeps` row queued) that the launcher then starts like a grid sweep's member. Asking is idempotent across
ticks: a member is stored before its run is requested, and the run key is the member key, so a tick that dies
between the two leaves a member the next tick launches, never a second run.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from dagster import SensorEvaluationContext

from assets.sweeps import sweep_members, warm_starts
from factory.home import FactoryPaths
from factory.sweep import (
    SweepDefinition,
    SweepError,
    add_member,
    member_key,
    trial_member,
    update_sweep,
    write_warm_start_spec,
)
from factory.sweep_search import ask
from resources import LakeResource
from resources.study import sweep_study


def ask_trials(context: SensorEvaluationContext, paths: FactoryPaths, lake: LakeResource, info: dict[str, Any],
               started: set[str], in_flight: int, limit: int) -> dict[str, Any]:
    """New trials for the tpe sweep `info` as far as its limit (`limit` runs in flight) allows; returns the sweep as
    stored after them (`search_done` set once every trial was asked)."""
    import optuna

    defn, sweep_id = info["definition"], info["sweep_id"]
    if info.get("search_done"):
        return info
    waiting = sum(m["key"] not in started for m in info["members"])
    room = limit - in_flight - waiting
    if room <= 0:
        return info
    study = sweep_study(context.instance, paths, info)
    asked = len(study.get_trials(deepcopy=False))
    space = SweepDefinition(**defn).space
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
    if len(study.get_trials(deepcopy=False)) >= defn["trials"]:
        info = dict(info, search_done=True)
        update_sweep(paths, sweep_id, info)
    return info

