"""Eval assets: the held-out report of a GRPO run against its SFT start and the more-SFT control."""


from dagster import AssetExecutionContext, MaterializeResult, MetadataValue, asset

from assets._metadata import upstream
from factory.experiment import eval_summary, render_report
from resources import LakeResource


@asset(group_name="evals", code_version="1", deps=["grpo_run", "sft_control"], kinds={"iceberg"})
def eval_report(context: AssetExecutionContext, lake: LakeResource) -> MaterializeResult:
    """Held-out accuracy of the SFT start, the GRPO result and the control, read back from Iceberg."""
    run_id = upstream(context, "grpo_run")["run_id"]
    s = eval_summary(lake.lake(), run_id)
    md = render_report(s)
    context.log.info(f"run {run_id}: held-out accuracy SFT {s['sft_accuracy']:.3f} -> GRPO {s['grpo_accuracy']:.3f}")
    metadata = {"report": MetadataValue.md(md), "run_id": run_id}
    for key in ("sft_accuracy", "grpo_accuracy", "control_accuracy", "gain", "sft_pass_at_8", "winner"):
        if s.get(key) is not None:
            metadata[key] = s[key]
    return MaterializeResult(metadata=metadata)
