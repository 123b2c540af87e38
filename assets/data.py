"""Data assets: one per prompt source of the spec, the blend GRPO trains on, and per-prompt statistics over runs.

The source assets are built from the spec the code location loads (`data_assets(spec)`, called by jobs/): one
`source_<name>` per entry of `data.sources`, or, without a `data` section, one for the task's training split
(from `task_dataset`). Generated sources (arithmetic, suite) are materialized, their data version the
source's version (a hash of what defines its rows). External ones (jsonl, parquet, hf_disk, iceberg) are
observed, not materialized: an observation records the file's content hash (the table's snapshot id) as the
data version, so a changed file is a new version and the blend downstream shows as stale.

`blend` opens the sources of the spec it runs with, plays the blend over the spec's steps (realized vs target
share, factory/cockpit/blend_report.py) and takes `blend_version` as its data version: a changed file, weight,
schedule, seed or curriculum is a new version. It refuses to run when that spec's sources are not the ones the
graph was built from (the lineage would be wrong). `prompt_stats` recomputes the lake's per-prompt pass rates
from the groups of finished runs; it is eager: a new `grpo_run` materialization requests it.
"""

import re
import warnings
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetIn,
    AssetKey,
    AssetsDefinition,
    AssetSpec,
    AutomationCondition,
    BetaWarning,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    ObserveResult,
    TableColumn,
    TableRecord,
    TableSchema,
    asset,
    multi_observable_source_asset,
)

from assets._metadata import embedded, inline_picture
from factory.config import ExperimentSpec, PromptFilterSpec
from factory.deploy.target import op_tags, role_tags
from factory.source_spec import SourceError
from resources import LakeResource, MlflowResource, SpecResource

OBSERVED_KINDS = ("jsonl", "parquet", "hf_disk", "iceberg")  # rows that live outside Factory: observed
BLEND_EXPERIMENT = "blends"  # the MLflow experiment whose runs hold the blend pictures (one run per version)
SHARES = "plots/shares.png"


def source_key(name: str) -> str:
    """The asset key of a source: `source_<name>` with characters Dagster does not allow in a name made `_`."""
    return "source_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def _sources_of(spec: ExperimentSpec) -> list[dict[str, Any]]:
    """What the source assets stand for: the `data.sources` entries, or the task's split without a data section."""
    if spec.data is None:
        return [{"name": spec.task.name, "kind": "task"}]
    return [dict(s) for s in spec.data.sources]


def _source_metadata(src: Any, entry: dict[str, Any]) -> dict[str, Any]:
    md: dict[str, Any] = {"rows": len(src), "version": src.version(), "kind": entry["kind"],
                          "block_rows": src.block_rows, "spec": MetadataValue.json(entry)}
    if "path" in entry:
        md["path"] = MetadataValue.path(str(getattr(src, "path", entry["path"])))
    return md


def _generated_source_asset(entry: dict[str, Any]) -> AssetsDefinition:
    @asset(name=source_key(entry["name"]), group_name="data", code_version="1", kinds={"python"},
           op_tags=role_tags("data"),
           description=f"Prompt source {entry['name']!r} ({entry['kind']}): generated, versioned by what defines "
                       f"its rows.")
    def _source(context: AssetExecutionContext) -> MaterializeResult:
        from factory.data.sources import make_source  # noqa: PLC0415 heavy: pyiceberg, duckdb; when the step runs

        src = make_source(entry)
        context.log.info(f"source {entry['name']}: {len(src)} rows, version {src.version()}")
        return MaterializeResult(metadata=_source_metadata(src, entry), data_version=DataVersion(src.version()))

    return _source


def _task_source_asset(spec: ExperimentSpec) -> AssetsDefinition:
    name = spec.task.name

    @asset(name=source_key(name), group_name="data", code_version="1", ins={"dataset": AssetIn("task_dataset")},
           kinds={"python"}, op_tags=role_tags("data"),
           description=f"The task's training split as the one prompt source {name!r} (the spec has no data section).")
    def _source(context: AssetExecutionContext, dataset: dict, spec: SpecResource) -> MaterializeResult:
        from factory.data.from_spec import task_source  # noqa: PLC0415 heavy: pyiceberg, duckdb; when the step runs
        from factory.runs.stages import load_dataset  # noqa: PLC0415 heavy: torch; when the asset runs

        train = load_dataset(dataset["path"]).train
        src = task_source(spec.spec().task, train)
        return MaterializeResult(metadata=_source_metadata(src, {"name": name, "kind": "task"}),
                                 data_version=DataVersion(src.version()))

    return _source


def _observed_sources_asset(entries: list[dict[str, Any]]) -> AssetsDefinition:
    by_key = {AssetKey(source_key(e["name"])): e for e in entries}
    specs = [AssetSpec(key, group_name="data", kinds={e["kind"] if e["kind"] != "hf_disk" else "huggingface"},
                       description=f"Prompt source {e['name']!r} ({e['kind']}, "
                                   f"{e.get('path') or e.get('table')}): observed; its data version is the "
                                   f"{'snapshot id' if e['kind'] == 'iceberg' else 'content hash'}.",
                       metadata={"spec": MetadataValue.json(e)})
             for key, e in by_key.items()]
    needs_lake = any(e["kind"] == "iceberg" for e in entries)

    # Dagster 1.13 marks @multi_observable_source_asset beta (SourceAsset, the older way, is deprecated): the
    # version is pinned below 1.14 in pyproject.toml and observation is tested (tests/jobs/test_data_assets.py).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BetaWarning)

        @multi_observable_source_asset(specs=specs, name="observe_sources", can_subset=True,
                                       required_resource_keys={"lake"} if needs_lake else set(),
                                       description="Observe the external prompt sources: content hash or "
                                                   "snapshot id as each one's data version.")
        def _observe(context):
            from factory.data.sources import make_source  # noqa: PLC0415 heavy: pyiceberg, duckdb

            catalog = context.resources.lake.lake() if needs_lake else None
            for key in sorted(context.selected_asset_keys, key=lambda k: k.to_user_string()):
                entry = by_key[key]
                try:
                    src = make_source(entry, catalog=catalog)
                    md = _source_metadata(src, entry)
                except (SourceError, OSError, ValueError) as e:
                    raise Failure(f"source {entry['name']!r} could not be observed: {e}") from None
                context.log.info(f"source {entry['name']}: {md['rows']} rows, version {md['version']}")
                yield ObserveResult(asset_key=key, data_version=DataVersion(md["version"]), metadata=md)

    return _observe


def spec_source_assets(spec: ExperimentSpec) -> list[AssetsDefinition]:
    """One asset per prompt source of `spec` (group `data`): generated ones materialized, external ones observed."""
    entries = _sources_of(spec)
    keys: dict[str, str] = {}
    for e in entries:
        k = source_key(e["name"])
        if k in keys:
            raise ValueError(f"data.sources: {keys[k]!r} and {e['name']!r} both make the asset name {k!r}; rename one")
        keys[k] = e["name"]
    if spec.data is None:
        return [_task_source_asset(spec)]
    out = [_generated_source_asset(e) for e in entries if e["kind"] not in OBSERVED_KINDS]
    observed = [e for e in entries if e["kind"] in OBSERVED_KINDS]
    return [*out, _observed_sources_asset(observed)] if observed else out


def blend_asset(spec: ExperimentSpec) -> AssetsDefinition:
    """The blend of `spec`'s sources (its deps are their assets; without a data section, the task's dataset is its
    input, the one `dataset`); at run time it uses the SpecResource's spec."""
    built_from = _sources_of(spec)
    ins = {"dataset": AssetIn("task_dataset")} if spec.data is None else {}

    @asset(group_name="data", code_version="1", deps=[source_key(e["name"]) for e in built_from], ins=ins,
           kinds={"python", "mlflow"}, op_tags=op_tags("blend"))
    def blend(context: AssetExecutionContext, spec: SpecResource, lake: LakeResource,
              mlflow: MlflowResource, **inputs: dict) -> MaterializeResult:
        """The prompt blend GRPO draws from: its sources, weights or schedule, seed and curriculum. Its data
        version is theirs hashed (`blend_version`), so a changed source file or weight is a new version. The
        metadata compares the realized share of each source with its target over the spec's steps."""
        # heavy: pyiceberg, duckdb, matplotlib, when the step runs
        from factory.cockpit.blend_report import blend_report  # noqa: PLC0415 heavy: matplotlib, duckdb
        from factory.data.from_spec import blend_version, open_sources  # noqa: PLC0415 heavy: pyiceberg, duckdb

        s = spec.spec()
        if _sources_of(s) != built_from:
            raise Failure(f"blend: the spec's sources {[e['name'] for e in _sources_of(s)]} are not the ones this code "
                          f"location's source assets were built from {[e['name'] for e in built_from]}; load the code "
                          f"location with this spec (FACTORY_SPEC=<path>, see jobs/__init__.py)")
        train = None
        if s.data is None:
            from factory.runs.stages import load_dataset  # noqa: PLC0415 heavy: torch; when the asset runs

            train = load_dataset(inputs["dataset"]["path"]).train
        needs_lake = s.data is not None and any(e["kind"] == "iceberg" for e in s.data.sources)
        sources = open_sources(s.resolved.blend, train, catalog=lake.lake() if needs_lake else None)
        version = blend_version(s.resolved.blend, sources)
        report = blend_report(s, sources)
        head, pictures = _pictures(mlflow, s, version, report)
        by_name = {src.name: src for src in sources}
        records = [TableRecord({"source": x.name, "version": by_name[x.name].version(), "rows": len(by_name[x.name]),
                                "target_share": round(x.target, 4), "realized_share": round(x.realized, 4),
                                "draws": x.draws, "max_quota_error": round(x.max_quota_error, 4)})
                   for x in report.sources]
        types = {"rows": "int", "draws": "int", "target_share": "float", "realized_share": "float",
                 "max_quota_error": "float"}
        schema = TableSchema([TableColumn(c, types.get(c, "string")) for c in records[0].data])
        context.log.info(f"blend {version}: {len(sources)} source(s), max quota error {report.max_quota_error:.3f} "
                         f"prompts over {report.draws} draws")
        return MaterializeResult(
            metadata={**head, "blend_version": version, "sources": MetadataValue.table(records, schema=schema),
                      "max_quota_error": report.max_quota_error, "draws": report.draws, "steps": report.steps,
                      "prompts_per_step": report.prompts_per_step, "seed": s.resolved.blend.seed,
                      "schedule": MetadataValue.json({str(k): v for k, v in s.resolved.blend.schedule().items()}),
                      **{f"share/{x.name}": x.realized for x in report.sources}, "pictures": pictures},
            data_version=DataVersion(version),
        )

    return blend


def _pictures(mlflow: MlflowResource, spec: ExperimentSpec, version: str, report: Any) -> tuple[dict, MetadataValue]:
    """The shares picture stored on the blend version's MLflow run (one per version, reused: equal blends draw
    equal bytes), drawn in place by its MLflow UI link; and embedded, one click away without the UI."""
    from factory.cockpit.reports import small, store  # noqa: PLC0415 heavy: mlflow, matplotlib; when the step runs

    tracker = mlflow.tracker()
    name = f"blend-{version}"
    exp = tracker.client.get_experiment_by_name(BLEND_EXPERIMENT)
    found = tracker.client.search_runs([exp.experiment_id], filter_string=f"tags.mlflow.runName = '{name}'",
                                       max_results=1) if exp is not None else []
    if found:
        run_id = found[0].info.run_id
        png = report.png()
    else:
        run_id = tracker.start_run(BLEND_EXPERIMENT, name, params={"data": spec.data.model_dump(mode="json")
                                                                   if spec.data else {"task": spec.task.name}},
                                   tags={"factory.blend_version": version})
        png = store(tracker, run_id, SHARES, lambda dpi: report.png(dpi=dpi))
        tracker.end_run(run_id)
    head = {"shares": inline_picture(f"realized vs target share of each source of blend {version} (served by the "
                                     f"MLflow UI; without it, open `pictures`)",
                                     tracker.artifact_url(run_id, small(SHARES)))}
    return head, embedded({"shares": png})


def stopped_teaching(stats: list[dict[str, Any]], min_attempts: int) -> int:
    """Prompts every recorded sample of which was right, or every one wrong, over at least `min_attempts` samples:
    their groups have no reward spread, so GRPO learns nothing from them."""
    return sum(1 for r in stats if r["attempts"] >= min_attempts and r["passes"] in (0, r["attempts"]))


@asset(group_name="data", code_version="1", deps=["grpo_run"], kinds={"iceberg"},
       automation_condition=AutomationCondition.eager(), op_tags=op_tags("prompt_stats"))
def prompt_stats(context: AssetExecutionContext, spec: SpecResource, lake: LakeResource) -> MaterializeResult:
    """Per prompt over every succeeded run: samples, passes, groups, runs, pass rate (the lake's `prompt_stats`,
    what `data.filter` skips prompts by). Recomputed when a run finishes; rows that did not change are not
    rewritten."""
    from factory.data.stats import update_prompt_stats  # noqa: PLC0415 heavy: pyiceberg, duckdb; when the step runs

    lk = lake.lake()
    written = update_prompt_stats(lk)
    rows = lk.read("prompt_stats").select(["source", "attempts", "passes"]).to_pylist()
    s = spec.spec()
    min_attempts = (s.data.filter if s.data is not None and s.data.filter else PromptFilterSpec()).min_attempts
    snap = lk.table("prompt_stats").current_snapshot()
    per_source: dict[str, int] = {}
    for r in rows:
        per_source[r["source"]] = per_source.get(r["source"], 0) + 1
    context.log.info(f"prompt_stats: {written} row(s) changed, {len(rows)} prompt(s)")
    return MaterializeResult(metadata={
        "rows": len(rows), "rows_changed": written, "stopped_teaching": stopped_teaching(rows, min_attempts),
        "min_attempts": min_attempts, "snapshot_id": str(snap.snapshot_id) if snap is not None else "",
        "prompts_by_source": MetadataValue.json(per_source)},
        data_version=DataVersion(str(snap.snapshot_id) if snap is not None else "empty"))


def data_assets(spec: ExperimentSpec) -> list[AssetsDefinition]:
    """The source assets of `spec` and the blend over them (what jobs/ registers for the loaded spec)."""
    return [*spec_source_assets(spec), blend_asset(spec)]


__all__ = ["blend_asset", "data_assets", "prompt_stats", "source_key", "spec_source_assets", "stopped_teaching"]
