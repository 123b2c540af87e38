"""The RL run of the `grpo_run` asset as a process of its own that reports back through Dagster Pipes: what the
trainer pods run on Kubernetes (`factory train-grpo SPEC`, launched by deploy/cluster.py) and what a local
subprocess launch runs: the run's `Pipeline` (runs/pipeline.py) trains in this process, as in the asset's own.

The run's inputs (the SFT checkpoint, the dataset, the factory run id that retries share) arrive as Pipes
extras; its result leaves as one asset materialization whose metadata is `run_scalars` (plain values, typed for
Pipes) with the checkpoint digest as the data version. The pictures and links are not sent through Pipes (a pod's
log lines are not the place for megabytes of PNG): the asset builds them from the lake and MLflow, for every
launch the same way, so the materialization looks the same wherever the run trained.

Exit codes are the CLI's (`runs/exit_codes.py`): 0 done, 1 failed (a node that failed preflight, or a crash:
retryable), 2 bad input, 4 needs a fix (non-finite loss, a service whose circuit breaker tripped), 8 the engine's
log-probs and the trainer's disagree (`core/gate.py`: a setup to fix); the launcher maps them onto retries.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR, open_dagster_pipes

from factory.cockpit.tracking import Tracker
from factory.config import ExperimentSpec
from factory.core.gate import LogprobGapError
from factory.core.loop import NonFiniteLoss
from factory.home import FactoryPaths
from factory.infra.supervisor import CircuitOpen
from factory.lake import Lake
from factory.ops.preflight.gate import PreflightFailed, gate
from factory.progress import Log, Throttle
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_LOGPROB_GAP, EXIT_NEEDS_FIX, EXIT_OK
from factory.runs.pipeline import Pipeline
from factory.runs.run_result import RunResult
from factory.runs.supervision import Supervision

EXTRAS = ("init_checkpoint", "dataset", "run_id")  # what the launcher must send
PATH_KEYS = ("checkpoint",)  # shown as paths in the Dagster UI
PROGRESS_EVERY_S = 5.0  # a Pipes log message each: enough to follow a run, few enough for a pod's log


@dataclass(frozen=True)
class RunInputs:
    init_checkpoint: str
    dataset: str
    run_id: str | None = None

    @classmethod
    def from_extras(cls, extras: dict[str, Any]) -> RunInputs:
        missing = [k for k in EXTRAS[:2] if not extras.get(k)]
        if missing:
            raise ValueError(f"Pipes extras: missing {', '.join(missing)} (the launcher sends {', '.join(EXTRAS)})")
        return cls(str(extras["init_checkpoint"]), str(extras["dataset"]), extras.get("run_id") or None)


def run_scalars(res: RunResult) -> dict[str, Any]:
    """A finished run's metadata other than pictures and links, in the order the asset shows it."""
    return {"run_id": res.run_id, "mlflow_run_id": res.mlflow_run_id, "checkpoint": str(res.checkpoint.path),
            "sha256": res.checkpoint.sha256, "steps": res.steps, "benchmark": res.benchmark,
            "start_accuracy": res.start_accuracy,
            "start_pass_at_k": res.start_pass_at_k, "accuracy": res.final_accuracy, "seconds": res.seconds,
            "attempts": res.attempt, "goodput": res.goodput}


def pipes_metadata(scalars: dict[str, Any]) -> dict[str, Any]:
    """`run_scalars` in Pipes' wire form: paths typed as paths, None as null, the rest inferred."""
    out: dict[str, Any] = {}
    for k, v in scalars.items():
        if k in PATH_KEYS:
            out[k] = {"raw_value": v, "type": "path"}
        elif v is None:
            out[k] = {"raw_value": None, "type": "null"}
        else:
            out[k] = v
    return out


def train(spec: ExperimentSpec, paths: FactoryPaths, inputs: RunInputs, log: Log = print
          ) -> RunResult:
    """Preflight-gate this node, then train (or continue) the run; its progress (step, reward, ETA) goes to `log`
    every PROGRESS_EVERY_S and at the last step, so a run on the cluster shows it in the Dagster run's log."""
    gate(spec.ops, paths, log=log)  # no training on a node whose latest preflight failed
    progress = Throttle(lambda p: log("progress: " + ", ".join(f"{k} {v}" for k, v in p.tags().items())),
                        every_s=PROGRESS_EVERY_S)
    with Lake.open(paths) as lake:
        return Pipeline(spec, paths, log=log, progress=progress).train(
            inputs.init_checkpoint, Path(inputs.dataset), lake, Tracker(paths), Supervision.IN_PROCESS,
            run_id=inputs.run_id)


def run_under_pipes(spec: ExperimentSpec, paths: FactoryPaths, fallback: RunInputs | None = None) -> int:
    """Train with the inputs the Pipes extras give (or `fallback` when not started by Dagster) and report the
    materialization; return an exit code."""
    if DAGSTER_PIPES_CONTEXT_ENV_VAR not in os.environ:  # not started by a Pipes launcher
        if fallback is None:
            print("factory: error: train-grpo: not started by Dagster Pipes; give --init and --dataset",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        res, code = _train_or_exit(spec, paths, fallback, print, lambda m: print(m, file=sys.stderr))
        if res is not None:
            said = ["not recorded" if a is None else f"{a:.3f}" for a in (res.start_accuracy, res.final_accuracy)]
            print(f"run {res.run_id}: {res.benchmark} accuracy {said[0]} -> {said[1]}", flush=True)
        return code
    with open_dagster_pipes() as pipes:
        try:
            inputs = RunInputs.from_extras(dict(pipes.extras))
        except ValueError as e:
            pipes.log.error(str(e))
            return EXIT_BAD_INPUT
        res, code = _train_or_exit(spec, paths, inputs, pipes.log.info, pipes.log.error)
        if res is not None:
            pipes.report_asset_materialization(metadata=pipes_metadata(run_scalars(res)),
                                               data_version=res.checkpoint.sha256)
    return code


def _train_or_exit(spec: ExperimentSpec, paths: FactoryPaths, inputs: RunInputs, log: Log,
                   error: Log) -> tuple[RunResult | None, int]:
    """`train`, its known failures turned into the exit codes of the module docstring (others propagate: 1)."""
    try:
        return train(spec, paths, inputs, log=log), EXIT_OK
    except PreflightFailed as e:
        error(str(e))
        return None, EXIT_FAILED
    except (NonFiniteLoss, CircuitOpen) as e:
        error(f"{type(e).__name__}: {e}")
        return None, EXIT_NEEDS_FIX
    except LogprobGapError as e:
        error(f"{type(e).__name__}: {e}")
        return None, EXIT_LOGPROB_GAP
