"""Dataset assets: the task's train and held-out splits, versioned by content."""


from dagster import AssetExecutionContext, DataVersion, MaterializeResult, MetadataValue, asset

from factory.deploy.target import op_tags
from resources import FactoryHomeResource, SpecResource


@asset(group_name="datasets", code_version="1", io_manager_key="lineage", kinds={"python"},
       op_tags=op_tags("task_dataset"))
def task_dataset(context: AssetExecutionContext, spec: SpecResource,
                 home: FactoryHomeResource) -> MaterializeResult:
    """The spec's task family (arithmetic, word problems, code, ...) as train and held-out splits drawn
    deterministically from the spec's seed, with no overlap. Named `arithmetic_dataset` before
    (docs/migrations.md)."""
    from factory.runs.stages import build_dataset  # noqa: PLC0415 heavy: torch; when the asset runs (see jobs/)

    s = spec.spec()
    ds = build_dataset(s, home.paths())
    context.log.info(f"dataset {ds.fingerprint}: {ds.n_train} train / {ds.n_eval} held-out at {ds.path}")
    return MaterializeResult(
        metadata={"path": MetadataValue.path(str(ds.path)), "fingerprint": ds.fingerprint,
                  "n_train": ds.n_train, "n_eval": ds.n_eval},
        data_version=DataVersion(ds.fingerprint),
    )
