"""Eval assets: the held-out report of a GRPO run against its SFT start and the more-SFT control, and
periodic evals of every recorded checkpoint on each benchmark of its task (a partition per checkpoint's benchmark)."""

import os
import warnings

from dagster import (
    AllPartitionMapping,
    AssetCheckResult,
    AssetCheckSpec,
    AssetDep,
    AssetExecutionContext,
    AssetIn,
    Config,
    DataVersion,
    DynamicPartitionsDefinition,
    Failure,
    MaterializeResult,
    MetadataValue,
    PreviewWarning,
    asset,
    in_process_executor,
)
from pydantic import Field

from assets._metadata import embedded, inline_picture
from assets.sweeps import sweep_member_run
from assets.training import grpo_run
from factory.deploy.target import op_tags, profile_name
from factory.runs.checkpoint_eval import evaluate_and_draw, parse_checkpoint_key, parse_eval_key, regression_check
from factory.text import markdown_image
from resources import FactoryHomeResource, LakeResource, MlflowResource


@asset(group_name="evals", code_version="1", ins={"run": AssetIn("grpo_run")}, deps=["sft_control"],
       kinds={"iceberg"}, op_tags=op_tags("eval_report"))
def eval_report(context: AssetExecutionContext, run: dict, lake: LakeResource) -> MaterializeResult:
    """Held-out accuracy of the SFT start, the GRPO result and the control on the run's own task's held-out set
    (`benchmark`: factory/lake/results.py), read back from Iceberg."""
    from factory.runs.stages import eval_summary, render_report  # noqa: PLC0415 heavy: torch; when the asset runs

    run_id = run["run_id"]
    s = eval_summary(lake.lake(), run_id)
    md = render_report(s)
    context.log.info(f"run {run_id}: {s['benchmark']} accuracy SFT {s['sft_accuracy']:.3f} -> GRPO "
                     f"{s['grpo_accuracy']:.3f}")
    metadata = {"report": MetadataValue.md(md), "run_id": run_id, "benchmark": s["benchmark"]}
    for key in ("sft_accuracy", "grpo_accuracy", "n", "control_accuracy", "gain", "sft_pass_at_8", "winner",
                "verdict", "gain_verdict"):
        if s.get(key) is not None:  # accuracies and their gain to 3 decimals, as they are shown everywhere
            metadata[key] = round(s[key], 3) if isinstance(s[key], float) else s[key]
    return MaterializeResult(metadata=metadata)


# ---------------------------------------------------------------- periodic evals of checkpoints

# One partition per eval a recorded checkpoint is owed: `<benchmark>|<run_id>@<step>` (runs/checkpoint_eval.py
# eval_key), added by the eval sensors with only the benchmarks of the checkpoint's task (envs/eval_suites.py
# applicable_benchmarks). The cross product of every checkpoint and every benchmark it replaced showed partitions
# that could never materialize ("Missing (4)": humaneval of arithmetic checkpoints). A humaneval eval is asked for
# by adding its key (`humaneval|<run_id>@<step>`) in the launch dialog.
checkpoint_evals = DynamicPartitionsDefinition(name="checkpoint_evals")


def _eval_executor():
    """The eval job's step runs in its run worker, not in a second process: the eval itself is the eval server's, so
    a step process would only add a Python start and a second load of the code location to each eval (figures in
    docs/results.md). FACTORY_EVAL_EXECUTOR=multiprocess restores Dagster's default (a process per step); under
    k8s the code location's executor (a pod per step) stays."""
    how = os.environ.get("FACTORY_EVAL_EXECUTOR", "in_process").strip().lower()
    if how not in ("in_process", "multiprocess"):
        raise ValueError(f"FACTORY_EVAL_EXECUTOR: expected in_process or multiprocess, got {how!r}")
    return in_process_executor if how == "in_process" and profile_name() != "k8s" else None


EVAL_EXECUTOR = _eval_executor()


class CheckpointEvalConfig(Config):
    regression_tolerance: float = Field(
        0.05, description="the no_regression check fails when accuracy drops by more than this (absolute) from "
        "the same run's previous evaluated checkpoint on the same benchmark")
    eval_server: bool = Field(
        True, description="evaluate through the home's eval server (factory/runs/eval_server.py; started on demand, "
        "exits when idle): no torch import or model start-up in this run's process. Falls back to evaluating "
        "in-process when the server cannot start or gives no answer. Off under FACTORY_PROFILE=k8s (a pod per step).")


# The check is partitioned like the asset, so the UI judges each execution against its own partition's latest
# materialization (unpartitioned, it was compared with whichever partition landed last and read "Not evaluated").
# Dagster 1.13 calls partitioned checks a preview; the version is pinned below 1.14 in pyproject.toml and the
# behavior is tested (tests/jobs/test_evals.py), so the warning is silenced here rather than printed on every load.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", PreviewWarning)
    NO_REGRESSION = AssetCheckSpec("no_regression", asset="checkpoint_eval", partitions_def=checkpoint_evals,
                                   description="accuracy did not drop beyond the tolerance since the same run's "
                                               "previous evaluated checkpoint on the same benchmark")


@asset(group_name="evals", code_version="2", partitions_def=checkpoint_evals, kinds={"pytorch", "iceberg"},
       deps=[grpo_run, AssetDep(sweep_member_run, partition_mapping=AllPartitionMapping())],
       check_specs=[NO_REGRESSION], op_tags=op_tags("checkpoint_eval"))
def checkpoint_eval(context: AssetExecutionContext, config: CheckpointEvalConfig, home: FactoryHomeResource,
                    lake: LakeResource, mlflow: MlflowResource):
    """One checkpoint recorded by a training run (`grpo_run`, a sweep member) scored on one benchmark (held-out
    split or a shipped suite); rows land in `evals`, and the run's held-out accuracy by step is redrawn."""
    try:
        checkpoint, benchmark = parse_eval_key(context.partition_key)
        run_id, step = parse_checkpoint_key(checkpoint)
    except ValueError as e:
        raise Failure(str(e)) from None
    try:
        drawn = _evaluate(context, config, home.paths(), lake, mlflow, run_id, step, benchmark)
    except (LookupError, ValueError) as e:
        raise Failure(f"checkpoint {checkpoint} on {benchmark}: {e}") from None
    res, picture = drawn.result, drawn.picture
    how = "reused the training run's own result for this checkpoint" if res.reused else "evaluated"
    context.log.info(f"{run_id} step {step} on {res.benchmark}: accuracy {res.accuracy:.3f} (n={res.n}; {how})")
    metadata = {}
    if drawn.evals_url:
        metadata["evals"] = inline_picture(
            f"held-out accuracy by step of {run_id}, every benchmark (served by the MLflow UI; without it, open "
            "`pictures`)", drawn.evals_url)
    # Step and n as text: numeric metadata is plotted across partitions, which would join unrelated runs.
    metadata |= {"run_id": run_id, "step": MetadataValue.text(str(step)), "benchmark": res.benchmark,
                 "accuracy": res.accuracy, "n": MetadataValue.text(str(res.n)), "reused": res.reused,
                 "checkpoint_sha256": res.sha256}
    if picture is not None:
        metadata["pictures"] = embedded({f"{run_id} on {res.benchmark}": picture})
    yield MaterializeResult(metadata=metadata, data_version=DataVersion(f"{res.sha256[:16]}-{res.accuracy:.6f}"))
    reg = drawn.regression
    if reg is None:  # a server started by an older version answers without it
        reg = regression_check(lake.lake(), run_id, step, res.benchmark, res.accuracy, config.regression_tolerance)
    yield AssetCheckResult(check_name="no_regression", passed=reg.passed, metadata=_check_metadata(
        res, reg, config.regression_tolerance, picture))


def _evaluate(context: AssetExecutionContext, config: CheckpointEvalConfig, paths, lake: LakeResource,
              mlflow: MlflowResource, run_id: str, step: int, benchmark: str):
    """The eval, its picture and the regression check, by the home's eval server when it answers (this process then
    imports neither torch nor mlflow nor matplotlib, and opens no lake), else in-process."""
    from factory.runs.eval_server import (  # noqa: PLC0415 the eval server's client; evals only
        EvalServerUnavailable,
        evaluate_remote,
    )

    if config.eval_server and profile_name() != "k8s":
        try:
            return evaluate_remote(paths, run_id, step, benchmark, tolerance=config.regression_tolerance)
        except EvalServerUnavailable as e:
            context.log.warning(f"evaluating in this process instead of the eval server: {e}")
    return evaluate_and_draw(paths, lake.lake(), mlflow.tracker(), run_id, step, benchmark,
                             config.regression_tolerance)


def _check_metadata(res, reg, tolerance: float, picture: bytes | None) -> dict:
    """What the check shows: every figure as text, so the UI does not plot them across runs and benchmarks
    (its plots join executions in wall-clock order), and the picture of this run and benchmark alone."""
    if reg.previous_step is None:
        compared = "nothing: the run's first evaluated checkpoint on this benchmark"
    else:
        compared = f"step {reg.previous_step} of the same run (accuracy {reg.previous_accuracy:.3f})"
    md = {"run_id": res.run_id, "benchmark": res.benchmark, "step": MetadataValue.text(str(res.step)),
          "accuracy": MetadataValue.text(f"{res.accuracy:.3f}"), "compared_with": compared,
          "drop": MetadataValue.text("—" if reg.drop is None else f"{reg.drop:+.3f}"),
          "tolerance": MetadataValue.text(f"{tolerance:.3f}")}
    if picture is not None:
        md["accuracy_by_step"] = MetadataValue.md(markdown_image(picture, f"{res.run_id} on {res.benchmark}"))
    return md
