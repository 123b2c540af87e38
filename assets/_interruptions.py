"""What a training asset's Dagster run says about a factory run that was interrupted and resumed: for each of
the run's interruptions (the lake's `interruptions` table), a warning in the run's log and an `AssetObservation`
of the asset with the cause in words, the step the attempt reached, the step the next one resumed from, the steps
trained again and the seconds lost, so the run's page shows "killed at step 17, resumed from step 10" where it
would otherwise show only the stack trace of the run that died."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dagster import AssetExecutionContext, AssetObservation, MetadataValue
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
    return len(rows)
