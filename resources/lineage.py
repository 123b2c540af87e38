"""The IO manager that hands an asset the upstream output its own run depends on.

The quickstart's assets pass files between them (the dataset's splits, the SFT checkpoint, the GRPO run's record)
by reference: a path, a digest, a run id, recorded in the upstream's materialization metadata. Reading "the latest
materialization" of the upstream would let two runs going at once take each other's files: run A trains its SFT
checkpoint, run B trains its own, and A's GRPO starts from B's. `LineageIOManager` instead loads the metadata of the
materialization made by the run that produced the input, the way Dagster wires an op's inputs to its upstream
outputs.
"""

from __future__ import annotations

from typing import Any, NoReturn

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    ConfigurableIOManager,
    DagsterEventType,
    DagsterInstance,
    DagsterInvariantViolationError,
    EventLogEntry,
    Failure,
    InputContext,
    OutputContext,
)

# What the LOADED_INPUT event shows of the reference, so the run's log says which upstream files a step used.
SHOWN = ("path", "sha256", "fingerprint", "run_id", "checkpoint")


class LineageIOManager(ConfigurableIOManager):
    """Loads an asset's input as the metadata values of the upstream materialization it depends on.

    - Upstream materialized in this run (or, in a re-execution, in the parent run that produced it): that run's
      materialization of the asset (and partition), never another run's, whatever finished since.
    - Upstream not materialized in this run (a run that selects only downstream assets, e.g. GRPO from the SFT
      checkpoint built yesterday, or a scheduled eval): its latest materialization, which is the one such a run
      depends on; the step's log says so. Never materialized at all: a `MissingUpstream` whose first read fails.

    Stores nothing: the assets return a MaterializeResult without a value, so Dagster never calls
    `handle_output`, and the reference lives in the materialization's metadata, which the instance's event log
    keeps per run and partition (shared by every process and pod of a run, as the instance is).
    """

    def handle_output(self, context: OutputContext, obj: Any) -> None:
        if obj is not None:
            raise TypeError(f"{context.asset_key.to_user_string()}: LineageIOManager stores no values; return a "
                            "MaterializeResult whose metadata holds the reference (path, digest)")

    def load_input(self, context: InputContext) -> dict[str, Any]:
        key = context.asset_key
        partition = context.asset_partition_key if context.has_asset_partitions else None
        run_id = producing_run(context)
        if run_id is not None and context.instance.has_run(run_id):
            entry = materialization_in_run(context.instance, run_id, key, partition)
            if entry is None:
                raise Failure(f"upstream asset {key.to_user_string()!r} was produced by run {run_id} but that run "
                              "recorded no materialization of it")
        else:
            entry = latest_materialization(context.instance, key, partition)
            if entry is None:
                return MissingUpstream(key.to_user_string())
            context.log.info(f"{key.to_user_string()} was not materialized in this run: using its latest "
                             f"materialization (run {entry.run_id})")
        md = {k: v.value for k, v in entry.asset_materialization.metadata.items()}
        context.add_input_metadata({"upstream_dagster_run": entry.run_id,
                                    **{k: str(md[k]) for k in SHOWN if k in md}})
        return md


class MissingUpstream(dict):
    """The input of an upstream never materialized: the asset's first read of it fails, naming the upstream. Failing
    at the read, not at the load, keeps what an asset checks before it reads its inputs first (the preflight gate
    names a failed node even when the upstreams are missing too). A dict, as the assets' inputs are typed."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key

    def _fail(self, *_: Any) -> NoReturn:
        raise Failure(f"upstream asset {self.key!r} has no materialization yet; materialize it first")

    __getitem__ = get = __iter__ = __len__ = __contains__ = keys = values = items = _fail


def producing_run(context: InputContext) -> str | None:
    """The run whose step produced this input (this run, or the parent of a re-execution). When the upstream is not
    part of the run, Dagster's output context has no run id, or a placeholder that names no run."""
    if context.upstream_output is None:
        return None
    try:
        return context.upstream_output.run_id
    except DagsterInvariantViolationError:
        return None


def materialization_in_run(instance: DagsterInstance, run_id: str, key: AssetKey,
                           partition: str | None) -> EventLogEntry | None:
    """`run_id`'s newest materialization of `key` (and `partition`)."""
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION,
                                           ascending=False).records
    for record in records:
        mat = record.event_log_entry.asset_materialization
        if mat is not None and mat.asset_key == key and (partition is None or mat.partition == partition):
            return record.event_log_entry
    return None


def latest_materialization(instance: DagsterInstance, key: AssetKey, partition: str | None) -> EventLogEntry | None:
    found = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, asset_partitions=[partition] if partition else None), limit=1).records
    return found[0].event_log_entry if found else None
