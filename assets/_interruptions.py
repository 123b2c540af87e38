"""What a training asset's Dagster run says about a factory run that was interrupted and resumed: for each of
the run's interruptions (the lake's `interruptions` table), a warning in the run's log and an `AssetObservation`
of the asset with the cause in words, the step the attempt reached, the step the next one resumed from, the steps
trained again and the seconds lost, so the run's page shows "killed at step 17, resumed from step 10" where it
would otherwise show only the stack trace of the run that died.

A run whose worker was killed outright shows Dagster's own account: its code server reports "Run execution process
... was terminated by signal 9 (SIGKILL). This usually indicates that the process was killed by the operating system
due to running out of memory..." (`dagster._utils.get_run_crash_explanation`, which adds that hint to every
SIGKILL). That event cannot be replaced; the retry that resumes the run adds Factory's own account beside it on the
failed run (`tell_the_failed_run`): the cause the lake recorded, the step reached and resumed from, and the retry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dagster import (
    AssetExecutionContext,
    AssetObservation,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    MetadataValue,
)
from dagster._core.events import EngineEventData
from pyiceberg.expressions import EqualTo

if TYPE_CHECKING:
    from factory.lake import Lake

# The lake's causes (factory/lake/schemas.py INTERRUPTION_CAUSES, and the stops of runs/rl_run.py) in words: what
# the attempt did, and why where the cause's name does not say it.
CAUSES: dict[str, tuple[str, str | None]] = {
    "killed": ("was killed", "it ended without a word: kill -9, the OOM killer, a lost node"),
    "signal": ("was stopped by a signal", None),
    "hang": ("hung and was killed", "no heartbeat"),
    "crash": ("crashed", None),
    "crash_loop": ("stopped", "a service it needs kept failing"),
    "non_finite_loss": ("stopped", "non-finite losses"),
    "logprob_gap": ("stopped", "the rollout engine's log-probs and the trainer's disagree past ops.max_logprob_gap"),
    "failed_preflight": ("was held back", "the node failed preflight"),
    "supervisor_lost": ("stopped", "its supervisor died: the Dagster run worker or `factory run`"),
    "lake_down": ("stopped", "the lake stayed down"),
    "disk_full": ("stopped", "the disk was full"),
}


def interruptions(lake: Lake, run_id: str) -> list[dict[str, Any]]:
    """The run's `interruptions` rows, oldest attempt first."""
    rows = lake.read("interruptions", EqualTo("run_id", run_id)).to_pylist()
    return sorted(rows, key=lambda r: r["attempt"])


def describe(row: dict[str, Any]) -> str:
    """One interruption in a sentence, e.g. "attempt 1 crashed at step 17; resumed from step 10 (7 steps trained
    again, 31 s lost)"."""
    verb, why = CAUSES.get(row["cause"], (row["cause"], None))
    at = "" if row.get("last_step") is None else f" at step {row['last_step']}"
    text = f"attempt {row['attempt']} {verb}{at}" + (f" ({why})" if why else "")
    if row.get("resumed_from_step") is None:
        return f"{text}; not resumed yet"
    lost = _lost_s(row)
    return (f"{text}; resumed from step {row['resumed_from_step']} "
            f"({row.get('steps_lost') or 0} steps trained again" + (f", {lost:.0f} s lost)" if lost else ")"))


def _lost_s(row: dict[str, Any]) -> float:
    return sum(row.get(k) or 0.0 for k in ("detect_s", "recover_s", "redo_s"))


def observation_metadata(run_id: str, row: dict[str, Any]) -> dict[str, Any]:
    """What the observation of one interruption shows (fields the lake left empty are left out)."""
    md: dict[str, Any] = {"run_id": run_id, "interrupted": describe(row), "cause": row["cause"],
                          "attempt": row["attempt"]}
    for key, name in (("last_step", "stopped_at_step"), ("resumed_from_step", "resumed_from_step"),
                      ("steps_lost", "steps_lost")):
        if row.get(key) is not None:
            md[name] = int(row[key])
    if row.get("resumed_from_step") is not None:
        md["lost_s"] = round(_lost_s(row), 1)
    if row.get("detail"):
        md["detail"] = MetadataValue.text(str(row["detail"])[:2000])
    return md


def report_interruptions(context: AssetExecutionContext, lake: Lake, run_id: str) -> int:
    """Log and observe each interruption of factory run `run_id` on the asset this step materializes; returns
    how many there were."""
    rows = interruptions(lake, run_id)
    partition = context.partition_key if context.has_partition_key else None
    for row in rows:
        context.log.warning(f"run {run_id}: {describe(row)}")
        context.log_event(AssetObservation(asset_key=context.asset_key, partition=partition,
                                           metadata=observation_metadata(run_id, row)))
    if rows and context.run.parent_run_id:
        tell_the_failed_run(context.instance, context.run, run_id, rows[-1])
    return len(rows)


DAGSTER_OOM_HINT = "running out of memory"  # in Dagster's account of any run worker killed by SIGKILL
FACTORY_ACCOUNT = "Factory: "  # how Factory's own account on a failed run starts


def tell_the_failed_run(instance: DagsterInstance, retry: DagsterRun, run_id: str, row: dict[str, Any]) -> bool:
    """On the run that `retry` re-executes (its parent, which failed): an engine event with Factory's account of
    the interruption `row` (the newest of factory run `run_id`: the attempt the parent was running) and of the
    retry that resumed it, beside Dagster's own (which, for a SIGKILLed worker, guesses "out of memory"). Once per
    parent: False when it already has one, or is not a failed run of this instance."""
    parent = instance.get_run_by_id(retry.parent_run_id) if retry.parent_run_id else None
    if parent is None or not parent.is_failure:
        return False
    logged = instance.all_logs(parent.run_id, of_type=DagsterEventType.ENGINE_EVENT)
    events = [e.dagster_event.message or "" for e in logged if e.dagster_event]
    if any(m.startswith(FACTORY_ACCOUNT) for m in events):
        return False
    guess = (" Dagster's out-of-memory hint above is the one it gives every run worker killed by SIGKILL: the "
             "run worker died; what the training run did is this." if any(DAGSTER_OOM_HINT in m for m in events)
             else "")
    message = f"{FACTORY_ACCOUNT}run {run_id}: {describe(row)}, by Dagster run {retry.run_id}.{guess}"
    instance.report_engine_event(message, parent, EngineEventData(metadata={
        **observation_metadata(run_id, row), "retry_run_id": MetadataValue.dagster_run(retry.run_id)}))
    return True
