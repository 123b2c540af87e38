"""Training assets: the SFT warm-start checkpoint, the GRPO run, and the more-SFT control.

The engine (torch, transformers) is imported inside each asset, so loading the code location (the UI,
sensors, run workers of light jobs) does not pay for it: `import jobs` takes ~1.5 s instead of ~7 s.
"""


from dagster import (
    AssetCheckResult,
    AssetExecutionContext,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)

from assets._metadata import progress_tags, run_metadata, upstream
from assets._retries import TRAINING_RETRY, factory_run_id, no_retry_for_what_needs_a_fix
from assets.preflight import require_healthy_node
from resources import FactoryHomeResource, LakeResource, MlflowResource, SpecResource


@asset(group_name="training", code_version="2", deps=["arithmetic_dataset"], kinds={"pytorch"})
def sft_checkpoint(context: AssetExecutionContext, spec: SpecResource,
                   home: FactoryHomeResource) -> MaterializeResult:
    """A short supervised warm start that teaches the answer format; HF-format checkpoint.

    Trained once per (model, task, SFT settings, seed): materializing it again with the same inputs reuses
    the checkpoint after checking its digest, so the data version stays the same and nothing downstream
    goes stale."""
    from factory.experiment import cached_sft_checkpoint, load_dataset

    s = spec.spec()
    splits = load_dataset(upstream(context, "arithmetic_dataset")["path"])
    res = cached_sft_checkpoint(s, home.paths(), splits, log=context.log.info, progress=progress_tags(context))
    return MaterializeResult(
        metadata={"path": MetadataValue.path(str(res.checkpoint.path)), "sha256": res.checkpoint.sha256,
                  "bytes": res.checkpoint.bytes, "accuracy": res.accuracy, "pass_at_k": res.pass_at_k,
                  "steps": res.steps, "seconds": res.seconds},
        data_version=DataVersion(res.checkpoint.sha256),
    )


@asset(group_name="training", code_version="1", deps=["sft_checkpoint", "arithmetic_dataset", "blend"],
       kinds={"pytorch", "iceberg", "mlflow"}, retry_policy=TRAINING_RETRY)
def grpo_run(context: AssetExecutionContext, spec: SpecResource, home: FactoryHomeResource,
             lake: LakeResource, mlflow: MlflowResource) -> MaterializeResult:
    """GRPO from the SFT checkpoint; every step lands in Iceberg `steps` and in MLflow. While it runs, the run's
    tags show its step, latest reward and ETA; its curves and evals by step are drawn in the metadata. A retry
    (automatic, up to 2) resumes the same run from its newest resume point."""
    from factory.experiment import load_dataset
    from factory.grpo_run import run_grpo
    from factory.reports import run_pictures

    s = spec.spec()
    require_healthy_node(context, s.ops, home, lake)  # the preflight gate: no training on a node that failed it
    splits = load_dataset(upstream(context, "arithmetic_dataset")["path"])
    init = upstream(context, "sft_checkpoint")["path"]
    lk, tracker = lake.lake(), mlflow.tracker()
    with no_retry_for_what_needs_a_fix():
        res = run_grpo(s, home.paths(), init, splits, lk, tracker, log=context.log.info,
                       progress=progress_tags(context), run_id=factory_run_id(context, s.name))
    head, tail = run_metadata(run_pictures(lk, tracker, res.run_id, res.mlflow_run_id), tracker, res.run_id,
                              res.mlflow_run_id)
    return MaterializeResult(
        metadata={**head, "checkpoint": MetadataValue.path(str(res.checkpoint.path)), "sha256": res.checkpoint.sha256,
                  "steps": res.steps, "start_accuracy": res.start_accuracy,
                  "start_pass_at_k": res.start_pass_at_k, "accuracy": res.final_accuracy,
                  "seconds": res.seconds, "attempts": res.attempt, "goodput": res.goodput, **tail},
        data_version=DataVersion(res.checkpoint.sha256),
    )


@asset_check(asset=grpo_run, description="Held-out accuracy after GRPO is above the SFT checkpoint's")
def grpo_beats_sft(context) -> AssetCheckResult:
    md = upstream(context, "grpo_run")
    gain = md["accuracy"] - md["start_accuracy"]
    return AssetCheckResult(passed=gain > 0, metadata={"sft_accuracy": md["start_accuracy"],
                                                       "grpo_accuracy": md["accuracy"], "gain": gain})


@asset(group_name="training", code_version="1", deps=["sft_checkpoint", "grpo_run", "arithmetic_dataset"],
       kinds={"pytorch", "iceberg"})
def sft_control(context: AssetExecutionContext, spec: SpecResource, home: FactoryHomeResource,
                lake: LakeResource) -> MaterializeResult:
    """The control: the GRPO run's wall time spent on more SFT from the same checkpoint instead."""
    from factory.experiment import load_dataset, run_sft_control
    from factory.models.checkpoint import load_checkpoint

    s = spec.spec()
    sft, run = upstream(context, "sft_checkpoint"), upstream(context, "grpo_run")
    splits = load_dataset(upstream(context, "arithmetic_dataset")["path"])
    model, tok = load_checkpoint(sft["path"])
    res = run_sft_control(s, home.paths(), splits, lake.lake(), run["run_id"], run["steps"], model, tok,
                          seconds=run["seconds"], sft_seconds_per_step=sft["seconds"] / max(1, sft["steps"]),
                          log=context.log.info)
    return MaterializeResult(metadata={"run_id": run["run_id"], "extra_sft_steps": res.steps,
                                       "accuracy": res.accuracy, "grpo_accuracy": run["accuracy"],
                                       "checkpoint": MetadataValue.path(str(res.checkpoint.path))})
