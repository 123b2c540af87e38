"""Eval assets: the held-out report of a GRPO run against its SFT start and the more-SFT control, and
periodic evals of every recorded checkpoint on every benchmark (partitioned checkpoint x benchmark)."""


from dagster import (
    AssetCheckResult,
    AssetCheckSpec,
    AssetExecutionContext,
    Config,
    DataVersion,
    DynamicPartitionsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    MultiPartitionsDefinition,
    StaticPartitionsDefinition,
    asset,
)
from pydantic import Field

from assets._metadata import upstream
from factory.checkpoint_eval import evaluate_recorded_checkpoint, parse_checkpoint_key, regression_check
from factory.envs.benchmarks import BENCHMARKS
from resources import FactoryHomeResource, LakeResource


@asset(group_name="evals", code_version="1", deps=["grpo_run", "sft_control"], kinds={"iceberg"})
def eval_report(context: AssetExecutionContext, lake: LakeResource) -> MaterializeResult:
    """Held-out accuracy of the SFT start, the GRPO result and the control, read back from Iceberg."""
    from factory.experiment import eval_summary, render_report  # heavy: see assets/training.py

    run_id = upstream(context, "grpo_run")["run_id"]
    s = eval_summary(lake.lake(), run_id)
    md = render_report(s)
    context.log.info(f"run {run_id}: held-out accuracy SFT {s['sft_accuracy']:.3f} -> GRPO {s['grpo_accuracy']:.3f}")
    metadata = {"report": MetadataValue.md(md), "run_id": run_id}
    for key in ("sft_accuracy", "grpo_accuracy", "control_accuracy", "gain", "sft_pass_at_8", "winner"):
        if s.get(key) is not None:
            metadata[key] = s[key]
    return MaterializeResult(metadata=metadata)


# ---------------------------------------------------------------- periodic evals of checkpoints

checkpoints = DynamicPartitionsDefinition(name="checkpoints")
benchmarks = StaticPartitionsDefinition(list(BENCHMARKS))
checkpoint_x_benchmark = MultiPartitionsDefinition({"checkpoint": checkpoints, "benchmark": benchmarks})


class CheckpointEvalConfig(Config):
    regression_tolerance: float = Field(
        0.05, description="the no_regression check fails when accuracy drops by more than this (absolute) from "
        "the run's previous evaluated checkpoint on the same benchmark")


@asset(group_name="evals", code_version="1", partitions_def=checkpoint_x_benchmark, kinds={"pytorch", "iceberg"},
       check_specs=[AssetCheckSpec("no_regression", asset="checkpoint_eval",
                                   description="accuracy did not drop beyond the tolerance since the run's "
                                               "previous checkpoint")])
def checkpoint_eval(context: AssetExecutionContext, config: CheckpointEvalConfig, home: FactoryHomeResource,
                    lake: LakeResource):
    """One recorded checkpoint scored on one benchmark (held-out split or a shipped suite); rows land in `evals`."""
    key = context.partition_key.keys_by_dimension
    try:
        run_id, step = parse_checkpoint_key(key["checkpoint"])
    except ValueError as e:
        raise Failure(str(e)) from e
    lk = lake.lake()
    try:
        res = evaluate_recorded_checkpoint(home.paths(), lk, run_id, step, key["benchmark"])
    except (LookupError, ValueError) as e:
        raise Failure(f"checkpoint {key['checkpoint']} on {key['benchmark']}: {e}") from e
    context.log.info(f"{run_id} step {step} on {res.benchmark}: accuracy {res.accuracy:.3f} (n={res.n})")
    yield MaterializeResult(
        metadata={"run_id": run_id, "step": step, "benchmark": res.benchmark, "accuracy": res.accuracy,
                  "n": res.n, "checkpoint_sha256": res.sha256},
        data_version=DataVersion(f"{res.sha256[:16]}-{res.accuracy:.6f}"),
    )
    reg = regression_check(lk, run_id, step, res.benchmark, res.accuracy, config.regression_tolerance)
    yield AssetCheckResult(
        check_name="no_regression", passed=reg.passed,
        metadata={"accuracy": res.accuracy, "previous_step": reg.previous_step if reg.previous_step is not None else -1,
                  "previous_accuracy": reg.previous_accuracy if reg.previous_accuracy is not None else float("nan"),
                  "drop": reg.drop if reg.drop is not None else 0.0, "tolerance": config.regression_tolerance},
    )
