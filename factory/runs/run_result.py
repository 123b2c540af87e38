"""What a training run returns (`RunResult`) and its headline, read back from its records.

The headline is the run's result as `lake/results.py` defines it, accuracy on its own task's held-out set at its
final evaluated step, with its baseline: the same benchmark at step 0, the start RL trained from. `headline` reads
it from the run's `evals` rows, so the run that just finished, a run that finished in other processes
(`finished_result`) and whoever reads it later say the same. `tell_mlflow` puts it on the run's MLflow run: the tag
`factory.headline_benchmark` and the metric `headline/accuracy` at every step that benchmark was evaluated (step 0
is the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pyiceberg.expressions import EqualTo

from factory.cockpit.tracking import Tracker
from factory.core.loop import StepRecord
from factory.digest import dir_digest
from factory.envs.eval_suites import HELD_OUT, SOURCE_BENCHMARK
from factory.lake.results import METRIC, RunOutcome, outcomes_from_evals, primary_benchmark
from factory.lake.writer import Lake
from factory.models.checkpoint import CheckpointInfo
from factory.runs import recovery


@dataclass
class RunResult:
    run_id: str
    mlflow_run_id: str
    checkpoint: CheckpointInfo
    steps: int
    start_accuracy: float | None  # the headline benchmark at step 0 (the baseline); None: not recorded
    start_pass_at_k: float | None
    final_accuracy: float | None  # the headline benchmark at the final step: the run's result; None: not recorded
    seconds: float  # wall time of the run over all its attempts
    records: list[StepRecord] = field(repr=False, default_factory=list)  # this attempt's steps
    attempt: int = 1
    goodput: float = 1.0
    benchmark: str = HELD_OUT  # the headline benchmark: the run's own task's held-out set (lake/results.py)


@dataclass(frozen=True)
class Headline:
    outcome: RunOutcome  # the run's result with its baseline (`outcome.start`)
    curve: dict[int, float]  # step -> accuracy on the headline benchmark, step 0 first
    start_pass_at_k: float | None  # pass@k of the headline benchmark at step 0, when measured

    @property
    def benchmark(self) -> str | None:
        return self.outcome.primary.benchmark if self.outcome.primary else None


def headline(lake: Lake, run_id: str) -> Headline:
    """The run's headline from its `evals` rows (see the module docstring)."""
    rows = lake.read("evals", EqualTo("run_id", run_id)).to_pylist()
    outcome = outcomes_from_evals(rows).get(run_id, RunOutcome(run_id, None, None))
    bench = outcome.primary.benchmark if outcome.primary else None
    curve = dict(sorted((r["step"], r["value"]) for r in rows if r["benchmark"] == bench and r["metric"] == METRIC))
    k = [r["value"] for r in rows if r["step"] == 0 and r["benchmark"] == bench and r["metric"].startswith("pass@")]
    return Headline(outcome, curve, k[0] if k else None)


def headline_source(sources: list[str]) -> str | None:
    """The blend source whose held-out set is a run's headline among one eval's (`sources` by name), by
    `lake/results.py`'s rule: the one source when there is one, else None (the task's held-out split)."""
    own = primary_benchmark([HELD_OUT, *(SOURCE_BENCHMARK + name for name in sources)])
    return own.removeprefix(SOURCE_BENCHMARK) if own.startswith(SOURCE_BENCHMARK) else None


def headline_accuracy(task_accuracy: float, by_source: dict[str, float]) -> float:
    """The headline among one eval's accuracies (the task's held-out split's, and each blend source's by name)."""
    own = headline_source(list(by_source))
    return task_accuracy if own is None else by_source[own]


def tell_mlflow(tracker: Tracker, mlflow_id: str, h: Headline) -> None:
    """The headline on the run's MLflow run: its benchmark as a tag, its accuracy at each evaluated step."""
    if h.benchmark is None:
        return
    tracker.set_tags(mlflow_id, {"factory.headline_benchmark": h.benchmark})
    for step, value in h.curve.items():
        tracker.log_metrics(mlflow_id, step, {"headline/accuracy": value})


def finished_result(lake: Lake, run_id: str) -> RunResult:
    """The recorded result of run `run_id`, which succeeded (e.g. under a supervisor, in other processes)."""
    row = recovery.run_row(lake, run_id)
    if row is None or row["status"] != "succeeded":
        raise ValueError(f"run {run_id}: no succeeded run recorded (status: {row and row['status']})")
    return recorded_result(lake, row)


def recorded_result(lake: Lake, row: dict) -> RunResult:
    """The recorded result of a run that succeeded, from its `runs` row and its evals."""
    h = headline(lake, row["run_id"])
    o = h.outcome
    path = Path(row["final_checkpoint"])
    digest, size = dir_digest(path)
    return RunResult(row["run_id"], row["mlflow_run_id"], CheckpointInfo(path, digest, size), o.step or 0,
                     o.start.value if o.start else None, h.start_pass_at_k, o.accuracy if o.primary else None,
                     row.get("wall_s") or 0.0, attempt=int(row.get("attempts") or 1), goodput=row.get("goodput") or 1.0,
                     benchmark=h.benchmark or HELD_OUT)
