"""The experiment's pipeline, assembled once: dataset -> SFT warm start -> the RL run -> the control -> the report, and
the one place where a run's supervision is chosen.

`factory run` (`runs/experiment.py` `run_experiment`), sweep members (`run_sweep_member`), the Dagster assets
(assets/training.py, assets/sweeps.py, through the launcher resource) and the Pipes entrypoint (`runs/pipes.py`) all
call a `Pipeline`; none of them picks how the RL run is supervised itself: they pass a `Supervision`
(runs/supervision.py: `in_process` or `supervised`; the CLI from its `--in-process` flag, the assets from the launcher
resource of their deployment) and `Pipeline.train` applies it the same way whatever the entry.

A data-parallel spec (`trainer.world_size` > 1) asked to train in a process that is no rank is supervised: its
attempts must be groups of ranks. A run that reports its periodic evals to a caller in this process (`on_eval`, a tpe
sweep's trial) trains in process: a child process could not tell it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from factory.cockpit.tracking import Tracker
from factory.config import ExperimentSpec
from factory.home import FactoryPaths
from factory.lake.writer import Lake
from factory.models.checkpoint import load_checkpoint
from factory.problem import Splits
from factory.runs.attempt import write_launch
from factory.runs.degraded import read_when_up
from factory.runs.restarts import supervise
from factory.runs.rl_run import EvalHook, new_run_id, run_rl
from factory.runs.run_result import RunResult, finished_result
from factory.runs.stages import (
    ControlResult,
    DatasetArtifact,
    Log,
    ProgressCallback,
    SFTResult,
    build_dataset,
    cached_sft_checkpoint,
    eval_summary,
    load_dataset,
    render_report,
    run_sft_control,
    train_sft_checkpoint,
)
from factory.runs.supervision import Supervision


class RunFailed(RuntimeError):
    """A supervised run that did not succeed; `code` is the exit code `factory run` returns."""

    def __init__(self, run_id: str, code: int):
        super().__init__(f"run {run_id} did not succeed (exit code {code}); see `factory runs` and the "
                         f"interruptions table; resume it with: factory resume {run_id}")
        self.run_id, self.code = run_id, code


@dataclass(frozen=True)
class Filing:
    """Where a run is filed beyond its own records: a sweep member's sweep and the MLflow run it nests under."""

    sweep_id: str | None = None
    mlflow_experiment: str | None = None  # default: the spec's name
    mlflow_parent_run_id: str | None = None


@dataclass
class Pipeline:
    """The stages of one spec's experiment, each writing under FACTORY_HOME and to the lake and MLflow as its stage
    function does (`runs/stages.py`, `runs/rl_run.py`); `log` and `progress` are told what happens."""

    spec: ExperimentSpec
    paths: FactoryPaths
    log: Log = print
    progress: ProgressCallback | None = None

    def dataset(self) -> tuple[DatasetArtifact, Splits]:
        """The task's splits, built once per fingerprint, and loaded."""
        ds = build_dataset(self.spec, self.paths)
        return ds, load_dataset(ds.path)

    def warm_start(self, splits: Splits, shared: bool = True) -> SFTResult:
        """The SFT warm start: `shared`, the one trained once per warm-start fingerprint and reused (the assets, sweep
        members); else trained for this experiment (`factory run`)."""
        if shared:
            return cached_sft_checkpoint(self.spec, self.paths, splits, log=self.log, progress=self.progress)
        return train_sft_checkpoint(self.spec, self.paths, splits, log=self.log)

    def supervision(self, asked: Supervision, on_eval: EvalHook | None = None) -> Supervision:
        """What `asked` comes to for this spec here (the module docstring's two exceptions)."""
        if asked == Supervision.IN_PROCESS and self.spec.trainer.world_size > 1 and "RANK" not in os.environ:
            return Supervision.SUPERVISED  # this process is no rank: each attempt is a group of ranks
        if asked == Supervision.SUPERVISED and on_eval is not None:
            self.log("the run reports its evals to this process (a tpe sweep's trial): it trains in this process")
            return Supervision.IN_PROCESS
        return asked

    def train(self, init_checkpoint: str | Path, splits: Splits | str | Path | None, lake: Lake, tracker: Tracker,
              supervision: Supervision, run_id: str | None = None, filing: Filing = Filing(),
              on_eval: EvalHook | None = None) -> RunResult:
        """The RL run `run_id` (new, or continued from its newest resume point) from `init_checkpoint`, supervised as
        `supervision` comes to (`supervision()`). A supervised run that does not succeed raises `RunFailed` with its
        exit code; an in-process one raises what stopped it (`run_rl`). `splits`: the dataset, loaded, or its
        directory (loaded only when the run trains here), or None (the spec's, built if need be)."""
        run_id = run_id or new_run_id(self.spec)
        if self.supervision(supervision, on_eval) == Supervision.SUPERVISED:
            # read only until the run has its row; the attempts read the dataset themselves
            write_launch(self.paths.checkpoints / run_id, self.spec, init_checkpoint, *_filed(filing))
            rc = supervise(self.paths, run_id, self.spec, log=self.log)
            if rc != 0:
                raise RunFailed(run_id, rc)
            return read_when_up(lambda: finished_result(lake, run_id), self.spec.ops.lake_outage_s, self.log)
        if splits is None:
            splits = self.dataset()[1]
        elif not isinstance(splits, Splits):
            splits = load_dataset(splits)
        return run_rl(self.spec, self.paths, init_checkpoint, splits, lake, tracker, log=self.log, run_id=run_id,
                      sweep_id=filing.sweep_id, mlflow_experiment=filing.mlflow_experiment,
                      mlflow_parent_run_id=filing.mlflow_parent_run_id, progress=self.progress, on_eval=on_eval)

    def control(self, splits: Splits, lake: Lake, warm_start: str | Path, sft_seconds_per_step: float, run_id: str,
                seconds: float, step: int | None = None) -> ControlResult:
        """Run `run_id`'s wall time (`seconds`) spent on more SFT from the same warm start instead, recorded at its
        final `step` (`stages.run_sft_control`)."""
        model, tok = load_checkpoint(warm_start)
        return run_sft_control(self.spec, self.paths, splits, lake, run_id,
                               self.spec.schedule.steps if step is None else step, model, tok, seconds=seconds,
                               sft_seconds_per_step=sft_seconds_per_step, log=self.log)

    def report(self, lake: Lake, run_id: str) -> dict:
        """The eval summary of finished run `run_id` with its rendered `report`, read once the lake answers."""
        return report_when_up(lake, run_id, self.spec.ops.lake_outage_s, self.log)


def report_when_up(lake: Lake, run_id: str, budget_s: float, log: Log = print, **kw) -> dict:
    """The eval summary of finished run `run_id` with its rendered `report`, read once the lake answers (an outage
    of up to `budget_s` is waited out; `sleep=` is the wait between tries)."""
    summary = read_when_up(lambda: eval_summary(lake, run_id), budget_s, log, **kw)
    summary["report"] = render_report(summary)
    return summary


def _filed(filing: Filing) -> tuple[str | None, str | None, str | None]:
    return filing.sweep_id, filing.mlflow_experiment, filing.mlflow_parent_run_id
