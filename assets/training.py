"""Training assets: the SFT warm-start checkpoint, the GRPO run, and the more-SFT control.

The engine (torch, transformers) is imported inside each asset, so loading the code location (the UI,
sensors, run workers of light jobs) does not pay for it: `import jobs` takes ~1.5 s instead of ~7 s.
"""


import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dagster import (
    AssetCheckResult,
    AssetExecutionContext,
    AssetIn,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    asset,
    asset_check,
)

from assets._interruptions import report_interruptions
from assets._metadata import progress_tags, run_metadata
from assets._retries import (
    TRAINING_RETRY,
    factory_run_id,
    no_retry_for_what_needs_a_fix,
    wait_for_previous_attempt,
    watched_by_run_worker,
)
from assets.preflight import require_healthy_node
from factory.deploy.target import op_tags
from resources import FactoryHomeResource, LakeResource, MlflowResource, SpecResource, TrainingLauncherResource

if TYPE_CHECKING:
    from factory.cockpit.tracking import Tracker
    from factory.config import ExperimentSpec
    from factory.lake.writer import Lake

# Inputs are the upstream materializations this run depends on (resources/lineage.py), each as its metadata values.
DATASET = AssetIn("task_dataset")
SFT = AssetIn("sft_checkpoint")
RUN = AssetIn("grpo_run")


@asset(group_name="training", code_version="2", ins={"dataset": DATASET}, io_manager_key="lineage",
       kinds={"pytorch"}, op_tags=op_tags("sft_checkpoint"))
def sft_checkpoint(context: AssetExecutionContext, dataset: dict, spec: SpecResource,
                   home: FactoryHomeResource) -> MaterializeResult:
    """A short supervised warm start that teaches the answer format; HF-format checkpoint.

    Trained once per (model, task, SFT settings, seed): materializing it again with the same inputs reuses
    the checkpoint after checking its digest, so the data version stays the same and nothing downstream
    goes stale."""
    from factory.runs.pipeline import Pipeline  # noqa: PLC0415 heavy: torch
    from factory.runs.stages import load_dataset  # noqa: PLC0415 heavy: torch

    s = spec.spec()
    res = Pipeline(s, home.paths(), log=context.log.info, progress=progress_tags(context)).warm_start(
        load_dataset(dataset["path"]), shared=True)
    return MaterializeResult(
        metadata={"path": MetadataValue.path(str(res.checkpoint.path)), "sha256": res.checkpoint.sha256,
                  "bytes": res.checkpoint.bytes, "accuracy": res.accuracy, "pass_at_k": res.pass_at_k,
                  "steps": res.steps, "seconds": res.seconds},
        data_version=DataVersion(res.checkpoint.sha256),
    )


@asset(group_name="training", code_version="1", ins={"sft": SFT, "dataset": DATASET}, deps=["blend"],
       io_manager_key="lineage", kinds={"pytorch", "iceberg", "mlflow"}, retry_policy=TRAINING_RETRY,
       op_tags=op_tags("grpo_run"))
def grpo_run(context: AssetExecutionContext, sft: dict, dataset: dict, spec: SpecResource, home: FactoryHomeResource,
             lake: LakeResource, mlflow: MlflowResource, launcher: TrainingLauncherResource) -> MaterializeResult:
    """GRPO from the SFT checkpoint; every step lands in Iceberg `steps` and in MLflow. While it runs, the run's
    tags show its step, latest reward and ETA; its curves and evals by step are drawn in the metadata. A retry
    (automatic, up to 2) resumes the same run from its newest resume point, and the run's log and the asset's
    observations say what interrupted it. Where it trains is the `launcher`'s choice for this deployment: in this
    process (supervised or not), or through Dagster Pipes in a child process or on Kubernetes: the metadata is the
    same. Training stops at a resume point if the run worker dies (assets/_retries.py `watched_by_run_worker`)."""
    s = spec.spec()
    run_id = factory_run_id(context, s.name)

    def inputs() -> dict:  # read once the launch's own checks passed: a failed node is named before a missing upstream
        return {"init_checkpoint": sft["path"], "dataset": dataset["path"], "run_id": run_id}

    lk, tracker = lake.lake(), mlflow.tracker()
    scalars = launcher.launch(context, spec, home, inputs, TrainingHere(context, s, home, lake, lk, tracker))
    report_interruptions(context, lk, run_id)
    return MaterializeResult(metadata=rl_run_metadata(scalars, lk, tracker),
                             data_version=DataVersion(scalars["sha256"]))


@dataclass
class TrainingHere:
    """What training from this step's own process needs around it (resources/launch.py `TrainingHere`), for the
    launcher: the records, the step's log and progress tags, and its guards (assets/_retries.py)."""

    context: AssetExecutionContext
    spec: "ExperimentSpec"
    home: FactoryHomeResource
    lake_resource: LakeResource
    lake: "Lake"
    tracker: "Tracker"

    @property
    def log(self):
        return self.context.log.info

    @property
    def progress(self):
        return progress_tags(self.context)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        # the preflight gate (a Pipes entrypoint gates its own node); a run retry can start while the dead worker's
        # trainer still finishes its step (assets/_retries.py)
        require_healthy_node(self.context, self.spec.ops, self.home, self.lake_resource)
        wait_for_previous_attempt(self.home.paths().checkpoints / factory_run_id(self.context, self.spec.name),
                                  self.spec.ops.hang_timeout_s, self.log)
        with no_retry_for_what_needs_a_fix(), watched_by_run_worker(self.context):
            yield

    def watch(self) -> contextlib.AbstractContextManager[object]:
        return watched_by_run_worker(self.context)  # a local `factory train-grpo` child watches the worker too


def rl_run_metadata(scalars: dict, lk, tracker) -> dict:
    """The run's scalars (factory/runs/pipes.py) with its pictures and MLflow link, drawn from the lake and MLflow:
    the same for every launch."""
    from factory.cockpit.reports import run_pictures  # noqa: PLC0415 heavy: pyiceberg

    run_id, mlflow_run_id = scalars["run_id"], scalars["mlflow_run_id"]
    head, tail = run_metadata(run_pictures(lk, tracker, run_id, mlflow_run_id), tracker, run_id, mlflow_run_id)
    rest = {k: v for k, v in scalars.items() if k not in ("run_id", "mlflow_run_id")}
    return {**head, **rest, "checkpoint": MetadataValue.path(str(scalars["checkpoint"])), **tail}


@asset_check(asset=grpo_run, description="Held-out accuracy after GRPO is above the SFT checkpoint's")
def grpo_beats_sft(grpo_run: dict) -> AssetCheckResult:  # named as the asset: its materialization in this run
    start, final = grpo_run["start_accuracy"], grpo_run["accuracy"]
    if start is None or final is None:  # an accuracy the lake does not hold: no gain to judge, not a gain of 0
        return AssetCheckResult(passed=False, description="not recorded: the run's start or final held-out accuracy "
                                "is missing from the lake")
    gain = final - start
    # Shown to 3 decimals, as accuracies are (a difference of two floats reads 0.020000000000000018).
    return AssetCheckResult(passed=gain > 0, metadata={"sft_accuracy": round(start, 3),
                                                       "grpo_accuracy": round(final, 3), "gain": round(gain, 3)})


@asset(group_name="training", code_version="1", ins={"sft": SFT, "run": RUN, "dataset": DATASET},
       kinds={"pytorch", "iceberg"}, op_tags=op_tags("sft_control"))
def sft_control(context: AssetExecutionContext, sft: dict, run: dict, dataset: dict, spec: SpecResource,
                home: FactoryHomeResource, lake: LakeResource) -> MaterializeResult:
    """The control: the GRPO run's wall time spent on more SFT from the same checkpoint instead."""
    from factory.runs.pipeline import Pipeline  # noqa: PLC0415 heavy: torch
    from factory.runs.stages import load_dataset  # noqa: PLC0415 heavy: torch

    res = Pipeline(spec.spec(), home.paths(), log=context.log.info).control(
        load_dataset(dataset["path"]), lake.lake(), sft["path"], sft["seconds"] / max(1, sft["steps"]), run["run_id"],
        run["seconds"], step=run["steps"])
    return MaterializeResult(metadata={"run_id": run["run_id"], "extra_sft_steps": res.steps,
                                       "accuracy": res.accuracy, "grpo_accuracy": run["accuracy"],
                                       "checkpoint": MetadataValue.path(str(res.checkpoint.path))})
