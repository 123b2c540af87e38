"""Node health: the `node_health` asset runs a preflight of this node (factory/ops/preflight/) and shows each check
as an asset check; `require_healthy_node` is the gate the training assets call before they train."""

from typing import Literal

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetSpec,
    Config,
    Failure,
    MaterializeResult,
    MetadataValue,
    TableColumn,
    TableRecord,
    TableSchema,
    multi_asset,
)
from pydantic import Field

from factory.config import OpsSpec
from factory.deploy.target import op_tags
from factory.ops.preflight import CHECK_NAMES, CheckResult, PreflightFailed, format_checks, gate, run_preflight
from resources import FactoryHomeResource, LakeResource

NODE_HEALTH = AssetKey("node_health")
_COLUMNS = [TableColumn("check"), TableColumn("status"), TableColumn("value"), TableColumn("threshold"),
            TableColumn("unit"), TableColumn("seconds"), TableColumn("message")]


class PreflightConfig(Config):
    mode: Literal["quick", "deep"] = Field("quick", description="quick (~15 s) or deep (longer measurements, "
                                           "all-reduce, rollout server, the whole sandbox red-team suite; 1-3 min)")


def require_healthy_node(context: AssetExecutionContext, ops: OpsSpec, home: FactoryHomeResource,
                         lake: LakeResource) -> None:
    """The preflight gate in front of a training asset: a dagster Failure naming the failed checks if this node's
    latest preflight failed (a quick one runs first when none is recent)."""
    lk = lake.lake()
    try:
        gate(ops, home.paths(), lk, log=context.log.info)
    except PreflightFailed as e:
        raise Failure(str(e), metadata={"failed_checks": ", ".join(e.checks), "node": e.node},
                      allow_retries=False) from None  # the node needs fixing first: a retry would be refused too
    finally:
        lk.close()


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _check_result(r: CheckResult) -> AssetCheckResult:
    return AssetCheckResult(
        asset_key=NODE_HEALTH, check_name=r.name, passed=r.passed, severity=AssetCheckSeverity.ERROR,
        description=r.message[:1000],
        metadata={"value": r.value, "threshold": r.threshold, "unit": r.unit, "expected": r.expected,
                  "seconds": round(r.duration_s, 3), "message": r.message})


@multi_asset(
    specs=[AssetSpec(NODE_HEALTH, group_name="ops", kinds={"iceberg"},
                     description="Preflight of this node: hardware, software, disks, lake, MLflow, sandbox; one "
                                 "`node_health` row per check. Training refuses a node whose latest preflight "
                                 "failed.")],
    check_specs=[AssetCheckSpec(name, asset=NODE_HEALTH, description=f"preflight check {name}")
                 for name in CHECK_NAMES],
    can_subset=True,  # quick mode has no result for the deep-only checks; one check can be re-run alone
    op_tags=op_tags("node_health"),
)
def node_health(context: AssetExecutionContext, config: PreflightConfig, home: FactoryHomeResource,
                lake: LakeResource):
    """Run this node's preflight (all checks of the mode, or only the checks selected), record it, show it."""

    selected = {k.name for k in context.selected_asset_check_keys}
    whole = NODE_HEALTH in context.selected_asset_keys
    lk = lake.lake()
    try:
        report = run_preflight(home.paths(), lk, mode=config.mode, only=None if whole else sorted(selected),
                               log=context.log.info)
    finally:
        lk.close()
    context.log.info("\n" + format_checks(report.results))
    if whole:
        rows = [TableRecord({"check": r.name, "status": "ok" if r.passed else "FAIL", "value": _fmt(r.value),
                             "threshold": _fmt(r.threshold), "unit": r.unit, "seconds": f"{r.duration_s:.2f}",
                             "message": r.message}) for r in report.results]
        yield MaterializeResult(asset_key=NODE_HEALTH, metadata={
            "passed": report.passed, "failed": ", ".join(r.name for r in report.failed) or "none",
            "node": report.node, "kind": report.kind, "mode": report.mode, "preflight_id": report.preflight_id,
            "seconds": round(report.seconds, 2), "recorded": report.recorded or report.record_error,
            "checks": MetadataValue.table(rows, schema=TableSchema(columns=_COLUMNS)),
        })
    for r in report.results:
        if r.name in selected:
            yield _check_result(r)
