"""The `sweep` job (launched from the launchpad) and the sensors that run its members and summarize it.

`sweep` validates every member spec first; a bad axis or base spec fails the run with a one-line error
and nothing is written or launched. It also refuses to start when nothing could launch its members under
their limit (no daemon running sensors, or `sweep_launcher` stopped). A valid sweep is written under
FACTORY_HOME/sweeps/<sweep_id>/, its members become partitions of `sweep_member_run` and its warm starts
partitions of `sweep_warm_start`, one `sweeps` row each (queued) and an MLflow parent run.

`sweep_launcher` then starts what the limit allows (`factory.cockpit.sweep.next_launches`): each shared SFT warm
start first, once, and the members that need it after it, never more than `max_concurrent` of the sweep's
runs in flight, whatever the instance's run queue says. A tpe sweep (`mode: tpe`) has no members up front:
the launcher asks its Optuna study for a trial whenever a slot is free, until `trials` were asked
(jobs/_search.py, factory/cockpit/sweep_search.py). Member runs carry their axis values as tags
(`axis/algorithm.lr: 0.0003`). `sweep_summarizer` materializes the summary once every member has ended, naming
the evals of their checkpoints still pending, and again as they land (jobs/_summary.py). Every sensor here says
why it skips a tick (shown on its ticks in the UI).
"""

import json
import time
from datetime import UTC, datetime
from typing import Any, Literal

from dagster import (
    AssetKey,
    Config,
    DefaultSensorStatus,
    Failure,
    MetadataValue,
    OpExecutionContext,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    define_asset_job,
    in_process_executor,
    job,
    op,
    sensor,
)
from dagster._core.definitions.selector import InstigatorSelector
from dagster._core.scheduler.instigation import InstigatorStatus
from pydantic import Field

from assets._retries import TRAINING_TAGS
from assets.sweeps import sweep_member_run, sweep_members, sweep_summary, sweep_warm_start, sweeps, warm_starts
from factory.cockpit.sweep import (
    LABEL_TAG,
    MEMBER_TAG,
    SWEEP_TAG,
    WARM_START_TAG,
    SweepDefinition,
    SweepError,
    axis_tags,
    next_launches,
    plan_sweep,
    read_control,
    read_sweep,
    set_control,
    short_label,
    sweep_dir,
    write_sweep,
    write_warm_start_spec,
)
from factory.cockpit.sweep_search import TRIAL_TAG
from factory.config import SpecError, parse_overrides
from jobs._queue import SUMMARY_TAGS, awaiting_retry, free_summary_slots, holds_slot, in_flight, summary_limit
from jobs._search import ask_trials
from jobs._summary import PENDING_TAG, VERSION_TAG, summary_states, sweep_ids
from jobs._ticks import described
from jobs.evals import checkpoint_eval_job
from resources import FactoryHomeResource, LakeResource, MlflowResource
from resources.study import sweep_study

KIND_TAG = "factory/kind"
# The warm start's run is retried too when its worker dies: the retry waits for the orphaned SFT (its lock) and reuses
# its checkpoint, so the partition ends succeeded rather than failed beside a checkpoint that exists.
sweep_warm_start_job = define_asset_job("sweep_warm_start_job", selection=[sweep_warm_start], tags=TRAINING_TAGS,
                                        description="A warm start shared by sweep members (queued by sweep_launcher).")
sweep_member_job = define_asset_job("sweep_member_job", selection=[sweep_member_run], tags=TRAINING_TAGS,
                                    description="One sweep member's training run (queued by sweep_launcher).")
sweep_summary_job = define_asset_job("sweep_summary_job", selection=[sweep_summary], tags=SUMMARY_TAGS,
                                     description="A finished sweep's summary (queued by sweep_summarizer).")
DAEMON_STALE_S = 120.0  # a sensor daemon silent this long is not running (it heartbeats every ~30 s)

# What the launchpad opens with: a sweep that runs as it stands (two learning rates on the quickstart, 100
# GRPO steps each with a held-out eval every 20, one member at a time; a few minutes on a laptop CPU).
EXAMPLE_SWEEP: dict[str, Any] = {
    "name": "lr-sweep", "base_spec": "examples/quickstart.yaml",
    "overrides": ["schedule.steps=100", "schedule.eval_every=20"],
    "axes": {"algorithm.lr": [1.0e-4, 3.0e-4]}, "mode": "grid", "max_concurrent": 1,
}


class SweepConfig(Config):
    """A sweep: a base spec, axes over its fields, grid or random. Every member is validated before any launches."""

    name: str = Field("sweep", description="names the sweep and its MLflow parent run")
    base_spec: str = Field("examples/quickstart.yaml", description="path of the base spec (YAML), relative to the "
                           "repository root")
    base_inline: dict[str, Any] | None = Field(None, description="the base spec inline (replaces base_spec)")
    overrides: list[str] = Field(default_factory=list,
                                 description="path=value (YAML value) for every member, e.g. 'schedule.steps=50'")
    axes: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="grid/random: spec field path -> the values to sweep, e.g. {'algorithm.lr': [1.0e-4, 3.0e-4], "
                    "'seed': [0, 1]} (the training seed is the axis `seed`)")
    mode: Literal["grid", "random", "tpe"] = Field("grid", description="grid: every combination; random: `samples` "
                                                   "of them; tpe: Optuna's TPE search over `space`, `trials` members")
    samples: int | None = Field(None, description="random mode: how many members (default: all)")
    draw_seed: int = Field(0, description="random mode: which combinations are drawn; tpe: the sampler's seed (not "
                           "the training seed)")
    max_concurrent: int = Field(2, description="runs of this sweep (members and shared warm starts) at once")
    seeds: list[int] = Field(default_factory=list, description="repeat every point over these training seeds, e.g. "
                             "[0, 1, 2]: the summary ranks points by their mean over seeds, with its interval")
    space: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="tpe: spec field path -> {low, high} (with log: true, step, type: int) or {choices: [...]}, e.g. "
                    "{'algorithm.lr': {'low': 1.0e-5, 'high': 1.0e-3, 'log': True}}")
    trials: int | None = Field(None, description="tpe: how many trials (members) in all")
    prune: Literal["median", "hyperband", "none"] = Field(
        "none", description="tpe: stop a member at a periodic eval (schedule.eval_every) when it is worse than the "
                            "finished trials (median, hyperband), or never (none)")
    prune_startup_trials: int = Field(3, description="tpe, prune: median: completed trials before any pruning")


@op(description="Validate every member, then record the sweep and queue its members (through the sensor).")
def plan_and_queue_sweep(context: OpExecutionContext, config: SweepConfig, home: FactoryHomeResource,
                         lake: LakeResource, mlflow: MlflowResource) -> dict:
    try:
        fields = config.model_dump()
        fields["overrides"] = parse_overrides(config.overrides)
        plan = plan_sweep(SweepDefinition(**fields))
    except SweepError as e:
        raise Failure(description=e.one_line(), metadata={"nothing_launched": True}, allow_retries=False) from None
    except (SpecError, ValueError) as e:
        message = "invalid sweep (nothing was launched): " + "; ".join(str(e).splitlines())
        raise Failure(description=message, metadata={"nothing_launched": True}, allow_retries=False) from None
    _require_launcher(context)
    for warning in plan.warnings:  # launched anyway: valid settings, but likely not what was meant
        context.log.warning(f"sweep {plan.sweep_id}: {warning}")
    paths = home.paths()
    search = {"steps": plan.base.schedule.steps, "eval_every": plan.base.schedule.eval_every}
    if plan.definition.mode == "tpe":  # the study is created now: a storage that cannot be reached fails the launch
        sweep_study(context.instance, paths, {"sweep_id": plan.sweep_id, "definition": plan.definition.model_dump(
            mode="json"), "search": search})
    tracker = mlflow.tracker()
    parent = tracker.start_run(experiment=config.name, run_name=plan.sweep_id,
                               params={"sweep": config.model_dump(mode="json")},
                               tags={"factory.sweep_id": plan.sweep_id, "factory.members": len(plan.members),
                                     # a tpe sweep's members are its trials, counted as the launcher asks them
                                     **({"factory.trials": config.trials} if config.mode == "tpe" else {})})
    now = datetime.now(UTC)
    lake.lake().upsert("sweeps", [dict(sweep_id=plan.sweep_id, member=m.key, name=config.name,
                                       axes=json.dumps(m.values, sort_keys=True), spec=m.spec.to_json(),
                                       status="queued", mlflow_parent_run_id=parent, created_at=now, recorded_at=now)
                                  for m in plan.members])
    for name, spec in plan.warm_starts().items():
        write_warm_start_spec(paths, name, spec)
    if plan.members:  # a tpe sweep has none yet: the launcher adds each as its trial is asked
        context.instance.add_dynamic_partitions(warm_starts.name, list(plan.warm_starts()))
        context.instance.add_dynamic_partitions(sweep_members.name, [m.key for m in plan.members])
    context.instance.add_dynamic_partitions(sweeps.name, [plan.sweep_id])
    # Last: the stored plan is what the launcher sensor reacts to, so its partitions must exist by then.
    write_sweep(plan, paths, extra={"mlflow_parent_run_id": parent, "search": search})
    context.add_output_metadata({"sweep_id": plan.sweep_id, "members": len(plan.members),
                                 "warm_starts": len(plan.warm_starts()), "max_concurrent": config.max_concurrent,
                                 "mlflow_parent_run_id": parent, "members_table": MetadataValue.md(_members_md(plan)),
                                 **({"warnings": MetadataValue.md("\n".join(f"- {w}" for w in plan.warnings))}
                                    if plan.warnings else {}),
                                 **({"trials": config.trials, "space": config.space, "prune": config.prune}
                                    if config.mode == "tpe" else {})})
    context.log.info(f"sweep {plan.sweep_id}: {len(plan.members)} members and {len(plan.warm_starts())} warm "
                     f"start(s) queued, {config.max_concurrent} run(s) at a time")
    return {"sweep_id": plan.sweep_id, "members": [m.key for m in plan.members]}


def _require_launcher(context: OpExecutionContext) -> None:
    """Refuse a sweep whose members would not be launched under their limit: the limit is the launcher
    sensor's, so a daemon must be running sensors on this instance and `sweep_launcher` must not be stopped."""
    beat = context.instance.get_daemon_heartbeats().get("SENSOR")
    if beat is None or time.time() - beat.timestamp > DAEMON_STALE_S:
        raise Failure(description="sweep refused (nothing was launched): no dagster daemon is running sensors on "
                      "this instance, so nothing would start its members under max_concurrent; start Factory "
                      "with `make ui` (or `dagster dev`) and launch again", metadata={"nothing_launched": True},
                      allow_retries=False)
    origin = context.dagster_run.remote_job_origin
    if origin is None:  # executed in process (tests, scripts): no code location to look the sensor up in
        return
    repo = origin.repository_origin
    selector = InstigatorSelector(location_name=repo.code_location_origin.location_name,
                                  repository_name=repo.repository_name, name="sweep_launcher")
    state = context.instance.get_instigator_state(repo.get_instigator_origin("sweep_launcher").get_id(),
                                                  selector.get_id())
    if state is not None and state.status == InstigatorStatus.STOPPED:
        raise Failure(description="sweep refused (nothing was launched): the sweep_launcher sensor is stopped, so "
                      "nothing would start its members under max_concurrent; turn it on under Automation and launch "
                      "again", metadata={"nothing_launched": True}, allow_retries=False)


def _members_md(plan) -> str:
    axes = list(plan.definition.axes)
    head = "| member | " + " | ".join(axes) + " | warm start |\n|---|" + "---|" * (len(axes) + 1)
    return head + "\n" + "\n".join(f"| {m.key} | " + " | ".join(str(m.values[a]) for a in axes) +
                                   f" | {m.warm_start} |" for m in plan.members)


@job(description="Launch a sweep: a base spec and axes over its fields; members run as their own runs.",
     tags={KIND_TAG: "sweep"}, executor_def=in_process_executor,  # one op: no step process to start
     config={"ops": {"plan_and_queue_sweep": {"config": EXAMPLE_SWEEP}}})
def sweep():
    plan_and_queue_sweep()


class SweepControlConfig(Config):
    """Change a running sweep: pause it, resume it, or raise or lower its max_concurrent."""

    sweep_id: str = Field(description="the sweep to change (its id, as the `sweep` run logged it)")
    paused: bool | None = Field(None, description="true: no member or trial starts (runs in flight go on); "
                                "false: resume; empty: unchanged")
    max_concurrent: int | None = Field(None, description="runs of this sweep at once from now on; empty: unchanged")


@op(description="Pause, resume or re-limit a sweep; the launcher applies it at its next tick.")
def change_sweep(context: OpExecutionContext, config: SweepControlConfig, home: FactoryHomeResource) -> dict:
    try:
        control = set_control(home.paths(), config.sweep_id, paused=config.paused,
                              max_concurrent=config.max_concurrent)
    except SweepError as e:
        raise Failure(description=e.one_line().replace("invalid sweep (nothing was launched)", "sweep unchanged"),
                      allow_retries=False) from None
    except FileNotFoundError as e:
        raise Failure(description=f"sweep unchanged: {e}", allow_retries=False) from None
    context.add_output_metadata({"sweep_id": config.sweep_id, **{k: str(v) for k, v in control.items()}})
    context.log.info(f"sweep {config.sweep_id}: " + ("paused" if control["paused"] else "running") +
                     (f", max_concurrent {control['max_concurrent']}" if control["max_concurrent"] else ""))
    return control


@job(description="Pause, resume, or raise or lower max_concurrent of a running sweep.", tags={KIND_TAG: "sweep"},
     executor_def=in_process_executor)
def sweep_control():
    change_sweep()


def _sweep_ids(home: FactoryHomeResource) -> list[str]:
    return sweep_ids(home.paths())


def _warm_state(context: SensorEvaluationContext, names: set[str]) -> dict[str, str]:
    ready = set(context.instance.get_materialized_partitions(AssetKey("sweep_warm_start")))
    state = {}
    for name in names:
        if name in ready:
            state[name] = "ready"
            continue
        last = context.instance.get_runs(RunsFilter(tags={WARM_START_TAG: name}), limit=1)
        state[name] = "none" if not last else "running" if holds_slot(context.instance, last[0]) else "failed"
    return state


def _holding(context: SensorEvaluationContext, runs: list) -> tuple[set[str], set[str]]:
    """The sweep's members and warm starts that hold a slot (a run queued, running, or failed and awaiting its
    automatic retry: jobs/_queue.py), each counted once (a run awaiting its retry and that retry are one), and those
    of them awaiting a retry."""
    holding, retrying = set(), set()
    for r in runs:
        key = r.tags.get(MEMBER_TAG) or r.tags.get(WARM_START_TAG) or r.run_id
        if awaiting_retry(context.instance, r):
            retrying.add(key)
            holding.add(key)
        elif holds_slot(context.instance, r):
            holding.add(key)
    return holding, retrying


@sensor(jobs=[sweep_warm_start_job, sweep_member_job], minimum_interval_seconds=1,
        default_status=DefaultSensorStatus.RUNNING,
        description=described("Starts each sweep's shared warm starts, then its members, at most max_concurrent runs "
                              "at once."))
def sweep_launcher(context: SensorEvaluationContext, home: FactoryHomeResource, lake: LakeResource,
                   mlflow: MlflowResource) -> SensorResult:
    finished = set(json.loads(context.cursor)) if context.cursor else set()
    requests, waiting = [], []
    for sweep_id in _sweep_ids(home):
        if sweep_id in finished:
            continue
        info = read_sweep(home.paths(), sweep_id)
        control = read_control(home.paths(), sweep_id)
        if control["paused"]:  # nothing new starts; its runs in flight go on (`sweep_control` resumes it)
            waiting.append(f"sweep {sweep_id} paused")
            continue
        limit = control["max_concurrent"] or info["definition"]["max_concurrent"]
        runs = context.instance.get_runs(RunsFilter(tags={SWEEP_TAG: sweep_id}))
        started = {r.tags[MEMBER_TAG] for r in runs if MEMBER_TAG in r.tags}
        holding, retrying = _holding(context, runs)
        flying = len(holding)
        tpe = info["definition"].get("mode") == "tpe"
        if tpe:  # members are asked from the study as slots free up (jobs/_search.py)
            info = ask_trials(context, home.paths(), lake, mlflow, info, started, holding, limit)
        members = info["members"]
        warm = _warm_state(context, {m["warm_start"] for m in members})
        launch = next_launches(members, started, warm, in_flight=flying, max_concurrent=limit)
        requests += [RunRequest(job_name=sweep_warm_start_job.name, run_key=f"{sweep_id}-{ws}", partition_key=ws,
                                tags={SWEEP_TAG: sweep_id, WARM_START_TAG: ws, KIND_TAG: "warm_start"})
                     for ws in launch.warm_starts]
        by_key = {m["key"]: m for m in members}
        # run_key = member key: Dagster never launches the same key twice, even if state is lost.
        requests += [RunRequest(job_name=sweep_member_job.name, run_key=key, partition_key=key,
                                tags={SWEEP_TAG: sweep_id, MEMBER_TAG: key, KIND_TAG: "sweep_member",
                                      LABEL_TAG: short_label(by_key[key]["values"])[:63],  # lr=3e-4,seed=1
                                      **axis_tags(by_key[key]["values"]), **_trial_tag(by_key[key])})
                     for key in launch.members]
        if launch.finished and (not tpe or info.get("search_done")):
            finished.add(sweep_id)
        elif not launch.warm_starts and not launch.members:
            waiting.append(_why_waiting(sweep_id, info, started, warm, flying, limit, retrying))
    return _result(context, requests, waiting, "no sweep has members left to start", cursor=sorted(finished))


def _why_waiting(sweep_id: str, info: dict[str, Any], started: set[str], warm: dict[str, str], flying: int,
                 limit: int, retrying: set[str]) -> str:
    """Why a sweep with members (or trials) left starts none this tick, in words."""
    if flying >= limit:
        again = (f" ({len(retrying)} failed, awaiting Dagster's retry: {', '.join(sorted(retrying))})"
                 if retrying else "")
        return f"sweep {sweep_id}: max_concurrent {limit} reached: {flying} running{again}"
    blocked = sorted({m["warm_start"] for m in info["members"] if m["key"] not in started
                      and warm.get(m["warm_start"]) == "running"})
    if blocked:
        return f"sweep {sweep_id}: waiting for warm start {', '.join(blocked)}"
    defn = info["definition"]
    if defn.get("mode") == "tpe":
        return f"sweep {sweep_id}: {len(info['members'])} of {defn['trials']} trials asked, every one started"
    return f"sweep {sweep_id}: {len(started)} of {len(info['members'])} members started, none can start now"


def _result(context: SensorEvaluationContext, requests: list[RunRequest], reasons: list[str], idle: str,
            cursor: list[str]) -> SensorResult:
    """The tick's requests, or why there are none (shown on the sensor's tick in the UI). Dagster takes a skip
    reason only from a tick that requests nothing, so the reasons of a tick that does request go to its log."""
    if requests:
        for reason in reasons:
            context.log.info(reason)
    return SensorResult(run_requests=requests, cursor=json.dumps(cursor),
                        skip_reason=None if requests else "; ".join(reasons) or idle)


def _trial_tag(member: dict[str, Any]) -> dict[str, str]:
    return {TRIAL_TAG: str(member["trial"])} if "trial" in member else {}


@sensor(job=sweep_summary_job, minimum_interval_seconds=10, default_status=DefaultSensorStatus.RUNNING,
        description=described("Summarizes a sweep once every member has ended, naming the evals still pending, and "
                              "again each time more of them land, until none is pending (one summary at a time, "
                              "whatever evals run)."))
def sweep_summarizer(context: SensorEvaluationContext, home: FactoryHomeResource,
                     lake: LakeResource) -> SensorResult:
    finished = set(json.loads(context.cursor)) if context.cursor else set()
    if not [s for s in _sweep_ids(home) if s not in finished]:
        return _result(context, [], [], "every sweep is summarized with every eval", cursor=sorted(finished))
    instance = context.instance
    states = summary_states(instance, home.paths(), lake.lake(), checkpoint_eval_job.name, skip=finished)
    free = free_summary_slots(instance)  # summaries have their own queue: a running eval does not hold them back
    requests, reasons = [], []
    for st in sorted(states, key=lambda s: not s.ahead):  # the first and the complete summaries first
        if st.final:
            finished.add(st.sweep_id)
        elif not st.due:
            reasons.append(st.reason)
        elif free <= 0:  # never two summaries at once (the summary limit, jobs/_queue.py)
            now = f", 1 requested now for sweep {requests[-1].partition_key}" if requests else ""
            reasons.append(f"{st.reason}; it waits: a summary is being drawn (summary limit {summary_limit(instance)}:"
                           f" {in_flight(instance, SUMMARY_TAGS)} running{now})")
        else:
            free -= 1
            prog = st.progress
            requests.append(RunRequest(run_key=f"summary-{st.sweep_id}-{prog.version}", partition_key=st.sweep_id,
                                       tags={SWEEP_TAG: st.sweep_id, **SUMMARY_TAGS, VERSION_TAG: prog.version,
                                             PENDING_TAG: str(len(prog.pending))}))
            if not prog.pending:
                finished.add(st.sweep_id)
    return _result(context, requests, reasons, "every sweep is summarized with every eval", cursor=sorted(finished))


__all__ = ["EXAMPLE_SWEEP", "SweepConfig", "SweepControlConfig", "sweep", "sweep_control", "sweep_dir",
           "sweep_launcher", "sweep_member_job", "sweep_summarizer", "sweep_summary_job", "sweep_warm_start_job"]
