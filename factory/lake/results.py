"""A run's result, defined once: the primary benchmark's accuracy at the run's final evaluated step, with its
baseline (the same benchmark at step 0, the start RL trained from) and the other whole benchmarks evaluated at that
same step beside it by name, each with its n (and so its 95% interval).

The primary benchmark is the held-out set of the run's own task, the problems its GRPO prompts come from: a run
whose prompts come from one blend source with a held-out set (`data.sources`, e.g. the SmolLM2 example's
reasoning-gym `chain_sum`) is read on that set (`source:<name>`); any other run on the task's held-out split
(`arithmetic_heldout`, which every run records: the task's split, or the common ground of a blend of several
sources); a run that recorded accuracy on one whole benchmark only has that one. The final evaluated step is the
greatest step with an accuracy eval on the primary benchmark: a finished run's final eval, a run still training's
latest. Slices (`bench/slice`) and other metrics (pass@k, the control's `sft_control_*`) are not a run's result.
Benchmarks are never averaged together: after a periodic carry_chains eval of the last checkpoint a run's result
is still its held-out accuracy, with carry_chains beside it.

`factory runs`, `best`, `compare`, the sweep summary, the run report and the demo all read a run's result here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pyiceberg.expressions import And, EqualTo, In

from factory.envs.eval_suites import HELD_OUT, SOURCE_BENCHMARK
from factory.intervals import Accuracy, accuracy_text
from factory.lake.writer import Lake

PRIMARY = HELD_OUT
METRIC = "accuracy"


@dataclass(frozen=True)
class Score:
    """One benchmark's accuracy at one step, measured on n problems."""

    benchmark: str
    value: float
    n: int | None

    def text(self) -> str:
        """`0.764 [0.725, 0.799] n=500`."""
        return accuracy_text(self.value, self.n)

    def accuracy(self) -> Accuracy | None:
        """As an `Accuracy` (for intervals and verdicts); None without a usable n."""
        return Accuracy(self.value, int(self.n)) if self.n else None


@dataclass(frozen=True)
class RunOutcome:
    """A run's result: `primary` at `step`, its baseline `start` (the primary benchmark at step 0, when recorded),
    and `others` (whole benchmarks evaluated at the same step) by name."""

    run_id: str
    step: int | None
    primary: Score | None
    others: dict[str, Score] = field(default_factory=dict)
    start: Score | None = None

    @property
    def accuracy(self) -> float | None:
        return self.primary.value if self.primary else None

    @property
    def n(self) -> int | None:
        return self.primary.n if self.primary else None

    def others_text(self) -> str:
        """`carry_chains 0.794 [0.732, 0.845] n=200; ...` (empty when none)."""
        return "; ".join(f"{name} {s.text()}" for name, s in sorted(self.others.items()))

    def text(self) -> str:
        """`arithmetic_heldout 0.764 [0.725, 0.799] n=500 at step 60, from 0.744 [0.704, 0.780] n=500 at step 0
        (carry_chains 0.794 [...] n=200)`."""
        if self.primary is None:
            return "no accuracy eval yet"
        start = f", from {self.start.text()} at step 0" if self.start is not None and self.step else ""
        rest = f" ({self.others_text()})" if self.others else ""
        return f"{self.primary.benchmark} {self.primary.text()} at step {self.step}{start}{rest}"


def primary_benchmark(benchmarks: Iterable[str]) -> str | None:
    """The benchmark a run's result is read on, among the whole benchmarks it recorded accuracy on (the module
    docstring): the one blend source's held-out set when it recorded exactly one (`source:<name>`); else the task's
    held-out split; else the only one; else None (several, none of them those: no result rather than a guess)."""
    names = {b for b in benchmarks if "/" not in b}
    sources = [b for b in names if b.startswith(SOURCE_BENCHMARK)]
    if len(sources) == 1:
        return sources[0]
    if PRIMARY in names:
        return PRIMARY
    return next(iter(names)) if len(names) == 1 else None


def outcomes_from_evals(rows: Iterable[dict]) -> dict[str, RunOutcome]:
    """Each run's result from its `evals` rows (any rows: other metrics and slices are skipped)."""
    by_run: dict[str, list[dict]] = {}
    for r in rows:
        if r["metric"] == METRIC and "/" not in r["benchmark"] and r["value"] is not None:
            by_run.setdefault(r["run_id"], []).append(r)
    return {run_id: _outcome(run_id, evals) for run_id, evals in by_run.items()}


def _outcome(run_id: str, evals: list[dict]) -> RunOutcome:
    primary = primary_benchmark(r["benchmark"] for r in evals)
    if primary is None:
        return RunOutcome(run_id, None, None)
    step = max(r["step"] for r in evals if r["benchmark"] == primary)
    at = {r["benchmark"]: Score(r["benchmark"], r["value"], r.get("n")) for r in evals if r["step"] == step}
    main = at.pop(primary)
    start = next((Score(primary, r["value"], r.get("n")) for r in evals
                  if r["step"] == 0 and r["benchmark"] == primary), None)
    return RunOutcome(run_id, step, main, at, start)


def run_outcomes(lake: Lake, run_ids: Iterable[str] | None = None) -> dict[str, RunOutcome]:
    """The result of each run in `run_ids` (every run with an accuracy eval when None) that has one; a run with
    no accuracy eval yet is absent from the answer."""
    where = EqualTo("metric", METRIC)
    if run_ids is not None:
        ids = sorted(set(run_ids))
        if not ids:
            return {}
        where = And(where, In("run_id", ids))
    return outcomes_from_evals(lake.read("evals", where).to_pylist())


def run_outcome(lake: Lake, run_id: str) -> RunOutcome:
    """The result of `run_id` (step and primary None when it has no accuracy eval yet)."""
    return run_outcomes(lake, [run_id]).get(run_id, RunOutcome(run_id, None, None))
