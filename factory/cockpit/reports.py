"""What the cockpit shows of runs and sweeps: pictures rendered from the lake and stored on MLflow runs, and
the per-member figures a sweep is compared by.

Pictures are stored as artifacts of the run's MLflow run (`plots/curves.png`, `plots/evals.png`,
`plots/metrics.png`, a sweep's on its parent run), so a Dagster asset can show them inline as a short markdown
image whose source is the MLflow UI (`Tracker.artifact_url`), and they stay current: a periodic eval re-renders
`plots/evals.png`.
The PNG bytes are returned too, for an embedded copy that needs no MLflow UI.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyiceberg.expressions import EqualTo, In

from factory.cockpit import metric_panel, plots
from factory.cockpit.sweep import member_short, short_label
from factory.cockpit.tracking import Tracker
from factory.envs.eval_suites import HELD_OUT
from factory.intervals import Accuracy, Interval, accuracy_text, mean_interval, verdict, welch
from factory.lake.results import RunOutcome, outcomes_from_evals
from factory.lake.writer import Lake

CURVES, EVALS, METRICS = "plots/curves.png", "plots/evals.png", "plots/metrics.png"
Render = Callable[[int], bytes]  # a picture at a given dpi
LAST_STEPS = 10  # a member's reward is its mean reward_mean over its last steps (one step is noisy)


def small(artifact_path: str) -> str:
    """Where the inline-sized copy of a picture is stored (`plots/curves.png` -> `plots/curves.small.png`)."""
    return artifact_path.removesuffix(".png") + ".small.png"


def store(tracker: Tracker, run_id: str, artifact_path: str, render: Render,
          inline: Callable[[], bytes] | None = None, full: bytes | None = None) -> bytes:
    """Store a picture on an MLflow run at full size and at the size drawn inside the Dagster UI (`small`: `render`
    at plots.INLINE_DPI, or `inline` for a picture with a layout of its own there); return the full-size PNG
    (`full` when the caller has rendered it already)."""
    full = full if full is not None else render(plots.DPI)
    tracker.log_png(run_id, artifact_path, full)
    tracker.log_png(run_id, small(artifact_path), inline() if inline else render(plots.INLINE_DPI))
    return full


@dataclass(frozen=True)
class RunPictures:
    curves: bytes  # reward and accuracy by step, with held-out evals
    evals: bytes | None  # held-out accuracy by step per benchmark (None: no evals yet)
    metrics: bytes | None = None  # the metric panel: every metric of `steps` by step (None: no step recorded)


def run_pictures(lake: Lake, tracker: Tracker | None, run_id: str, mlflow_run_id: str | None = None) -> RunPictures:
    """Render a run's curves, its evals by step and its metric panel from the lake; store them on its MLflow run."""
    steps = lake.read("steps", EqualTo("run_id", run_id)).to_pylist()
    evals = lake.read("evals", EqualTo("run_id", run_id)).to_pylist()
    curves = functools.partial(plots.run_curves_png, steps, evals, run_id)
    by_step = _evals_png(evals, run_id)
    panel = functools.partial(metric_panel.metric_panel_png, steps, f"metrics by step: {run_id}") if steps else None
    if tracker is not None and mlflow_run_id:
        return RunPictures(store(tracker, mlflow_run_id, CURVES, curves),
                           store(tracker, mlflow_run_id, EVALS, by_step) if by_step else None,
                           store(tracker, mlflow_run_id, METRICS, panel, functools.partial(panel, inline=True))
                           if panel else None)
    return RunPictures(curves(plots.DPI), by_step(plots.DPI) if by_step else None,
                       panel(plots.DPI) if panel else None)


def refresh_evals_picture(lake: Lake, tracker: Tracker | None, run_id: str, benchmark: str | None = None
                          ) -> bytes | None:
    """After a new eval of `run_id`: re-render its evals-by-step picture (all benchmarks) on its MLflow run, and
    return the picture of `benchmark` alone (all benchmarks when None); None when nothing can be drawn."""
    evals = lake.read("evals", EqualTo("run_id", run_id)).to_pylist()
    runs = lake.read("runs", EqualTo("run_id", run_id)).to_pylist()
    mlflow_run_id = runs[0]["mlflow_run_id"] if runs else None
    every = _evals_png(evals, run_id)
    if tracker is not None and mlflow_run_id and every is not None:
        store(tracker, mlflow_run_id, EVALS, every)
    one = every if benchmark is None else _evals_png(evals, f"{run_id}: {benchmark}", [benchmark])
    return one(plots.DPI) if one else None


def _evals_png(evals: list[dict], title: str, benchmarks: list[str] | None = None) -> Render | None:
    """The evals-by-step picture as a renderer, or None when there is nothing to draw yet (no accuracy rows)."""
    try:  # a thumbnail-sized render: the plot raises when it has nothing to draw
        plots.evals_over_steps_png(evals, title=f"held-out accuracy by step: {title}", benchmarks=benchmarks, dpi=10)
    except ValueError:
        return None
    return lambda dpi: plots.evals_over_steps_png(evals, title=f"held-out accuracy by step: {title}",
                                                  benchmarks=benchmarks, dpi=dpi)


# ---------------------------------------------------------------- sweeps


@dataclass(frozen=True)
class MemberFigures:
    member: str
    axes: dict[str, Any]
    label: str  # the member told apart by its axis values, `lr=3e-4,seed=1` (factory/cockpit/sweep.py short_label)
    status: str
    run_id: str | None
    mlflow_run_id: str | None
    accuracy: float | None  # the run's result: held-out greedy accuracy at its final evaluated step
    n: int | None  # problems that accuracy was measured on (None: only the `sweeps` row's figure is known)
    pass_at_k: float | None  # final held-out pass@k (k from the spec)
    k: int | None
    reward: float | None  # mean training reward over the last LAST_STEPS steps
    steps: int
    wall_s: float | None  # the training run's wall time (GRPO, from `runs`)
    checkpoint: str | None
    others: str = ""  # the other benchmarks at the same step, `carry_chains 0.794 [0.732, 0.845] n=200`
    eval_step: int | None = None  # the step `accuracy` was measured at (None: only the `sweeps` row's figure)
    benchmark: str | None = None  # the benchmark `accuracy` is on (the run's held-out split)
    rank: int | None = None  # 1 for the best final result; None: not ranked (no final result: pruned, failed, ...)

    def accuracy_text(self) -> str:
        """`0.764 [0.725, 0.799] n=500`."""
        return accuracy_text(self.accuracy, self.n)


@dataclass(frozen=True)
class PointFigures:
    """One point of a sweep (its axis values other than `seed`) over the seeds it was trained with."""

    label: str  # its axis values other than `seed`, `lr=3e-4`
    members: list[str]
    seeds: list[Any]
    accuracies: list[float]  # one per seed, in `seeds` order
    mean: float
    interval: Interval | None  # 95% t interval of the mean over seeds (None: fewer than 2 seeds)
    n: int | None  # problems each accuracy was measured on

    def text(self) -> str:
        """`0.712 [0.690, 0.734] over 3 seeds, n=500 each` (the interval is over seeds)."""
        ci = f" [{self.interval.low:.3f}, {self.interval.high:.3f}]" if self.interval else ""
        each = f", n={self.n} each" if self.n else ""
        return f"{self.mean:.3f}{ci} over {len(self.seeds)} seed{'s' if len(self.seeds) != 1 else ''}{each}"


@dataclass(frozen=True)
class SweepComparison:
    sweep_id: str
    members: list[MemberFigures]  # the ranked ones best first (`rank` 1, 2, ...), then the others by member key
    # The top member and every finished member not significantly below it (95% interval of the difference includes
    # 0), or, without n, every member sharing the top accuracy: one name is a win, several a tie.
    best: list[str] = field(default_factory=list)
    pictures: dict[str, Render] = field(default_factory=dict)  # name -> picture at a dpi
    verdict: str = ""  # the top member against the runner-up: `m001 wins (diff ...)` or `no significant difference`
    # With a `seed` axis: the sweep's points (members grouped by their other axes) ranked by their mean over seeds,
    # and the top point against the runner-up (`seed_points`).
    points: list[PointFigures] = field(default_factory=list)
    point_verdict: str = ""
    ranked_by: str = ""  # what the ranking compares, and which members it leaves out (`ranked_by`)

    @property
    def top(self) -> MemberFigures | None:
        """The best-ranked member (rank 1), None when no member has a final result."""
        return self.members[0] if self.members and self.members[0].rank == 1 else None


def compare_sweep(lake: Lake, sweep_id: str) -> SweepComparison:
    """Every member of a sweep with its figures from the lake and the overlay pictures. Only final results are
    ranked (succeeded members, each at its final evaluated step, as `factory best` ranks runs): a pruned or failed
    member's accuracy is from an earlier step (a pruned one's from the eval that pruned it), so it is listed after
    them, unranked, and `ranked_by` says so."""
    rows = lake.read("sweeps", EqualTo("sweep_id", sweep_id)).to_pylist()
    if not rows:
        raise LookupError(f"sweep {sweep_id}: no rows in the `sweeps` table")
    run_ids = sorted({r["run_id"] for r in rows if r["run_id"]})
    steps = _by_run(lake.read("steps", In("run_id", run_ids)).to_pylist() if run_ids else [])
    evals = _by_run(lake.read("evals", In("run_id", run_ids)).to_pylist() if run_ids else [])
    runs = {r["run_id"]: r for r in (lake.read("runs", In("run_id", run_ids)).to_pylist() if run_ids else [])}
    outcomes = outcomes_from_evals(r for rs in evals.values() for r in rs)
    members = [_figures(r, steps.get(r["run_id"], []), evals.get(r["run_id"], []), runs.get(r["run_id"]),
                        outcomes.get(r["run_id"])) for r in sorted(rows, key=lambda r: r["member"])]
    done = sorted((m for m in members if m.status == "succeeded" and m.accuracy is not None),
                  key=lambda m: (-m.accuracy, m.member))
    done = [dataclasses.replace(m, rank=i) for i, m in enumerate(done, 1)]
    ranked = {m.member for m in done}
    members = done + [m for m in members if m.member not in ranked]
    best, text = best_members(done)
    if len(done) == 1:
        text = f"{_name(done[0])} is the only member with a final result: nothing to compare it with"
    elif not done:
        text = "no member has a final result (none succeeded): nothing is ranked"
    overlay = [{"label": m.label, "steps": steps.get(m.run_id, []), "evals": evals.get(m.run_id, [])}
               for m in sorted(members, key=lambda m: m.member) if m.run_id]
    pictures: dict[str, Render] = {}
    for bench in _whole_benchmarks(evals):
        title = f"{sweep_id}: members on {bench}"
        try:
            plots.sweep_curves_png(overlay, title=title, benchmark=bench, dpi=10)  # raises when nothing to draw
        except ValueError:
            continue
        short = "heldout" if bench == HELD_OUT else bench
        pictures[f"members_on_{short}"] = functools.partial(_overlay, overlay, title, bench)
    points, point_text = seed_points(done)
    return SweepComparison(sweep_id, members, best, pictures, text, points, point_text, ranked_by(members))


def ranked_by(members: list[MemberFigures]) -> str:
    """What a sweep's ranking compares, in words: `final held-out accuracy (arithmetic_heldout) of the 3 succeeded
    members, each at its final evaluated step (40); not ranked (no final result): m002 pruned at step 20`."""
    done = [m for m in members if m.rank is not None]
    rest = [m for m in members if m.rank is None]
    if done:
        benches = sorted({m.benchmark for m in done if m.benchmark})
        steps = sorted({m.eval_step for m in done if m.eval_step is not None})
        on = f" ({', '.join(benches)})" if benches else ""
        at = f" ({', '.join(map(str, steps))})" if steps else ""
        text = (f"final held-out accuracy{on} of the {len(done)} succeeded member{'s' if len(done) != 1 else ''}, "
                f"each at its final evaluated step{at}")
    else:
        text = "nothing ranked: no member succeeded with an accuracy eval"
    if rest:
        text += "; not ranked (no final result): " + ", ".join(
            f"{member_short(m.member)} {m.status}" + (f" at step {m.eval_step}" if m.eval_step is not None else "")
            for m in rest)
    return text


SEED = "seed"  # the axis a sweep repeats its points over; the summary aggregates it


def seed_points(done: list[MemberFigures]) -> tuple[list[PointFigures], str]:
    """Finished members grouped by their axis values other than `seed`, ranked by their mean accuracy over seeds
    (best first), and the top point against the runner-up: a win only when Welch's 95% interval of the difference
    of means excludes 0. Empty when the sweep has no `seed` axis with at least two seeds."""
    if len({json.dumps(m.axes.get(SEED)) for m in done if SEED in m.axes}) < 2:
        return [], ""
    groups: dict[str, list[MemberFigures]] = {}
    for m in done:
        groups.setdefault(short_label({k: v for k, v in m.axes.items() if k != SEED}), []).append(m)
    points = []
    for label, ms in groups.items():
        ms = sorted(ms, key=lambda m: json.dumps(m.axes.get(SEED)))
        accs = [m.accuracy for m in ms]
        ns = {m.n for m in ms}
        points.append(PointFigures(label, [m.member for m in ms], [m.axes.get(SEED) for m in ms], accs,
                                   sum(accs) / len(accs), mean_interval(accs) if len(accs) > 1 else None,
                                   ns.pop() if len(ns) == 1 else None))
    points.sort(key=lambda p: (-p.mean, p.label))
    if len(points) < 2 or len(points[0].accuracies) < 2 or len(points[1].accuracies) < 2:
        return points, ""
    top, second = points[0], points[1]
    ci = welch(top.accuracies, second.accuracies)
    detail = (f"mean diff {top.mean - second.mean:+.3f}"
              + (f" [{ci.low:+.3f}, {ci.high:+.3f}]" if ci else " (no spread across seeds to judge it by)")
              + f", {len(top.seeds)} and {len(second.seeds)} seeds")
    if ci is not None and ci.excludes_zero():
        return points, f"{top.label or 'the base point'} wins ({detail})"
    return points, f"no significant difference between {top.label} and {second.label} ({detail})"


def best_members(done: list[MemberFigures]) -> tuple[list[str], str]:
    """The best of finished members sorted best first, and the verdict of the top one against the runner-up.

    The best are the top member and every member whose accuracy is not significantly below it (Newcombe's 95%
    interval of the difference includes 0); members without n (only their `sweeps` row's figure) tie only on
    equal accuracy. One name is a win; several are a tie within the noise."""
    if not done:
        return [], ""
    top = done[0]
    best = [top.member]
    for m in done[1:]:
        if top.n and m.n:
            same = verdict("top", Accuracy(top.accuracy, top.n), "m", Accuracy(m.accuracy, m.n)).winner is None
        else:
            same = math.isclose(m.accuracy, top.accuracy, abs_tol=1e-12)
        if same:
            best.append(m.member)
    if len(done) < 2 or not (top.n and done[1].n):
        return best, ""
    return best, verdict(_name(top), Accuracy(top.accuracy, top.n), _name(done[1]),
                         Accuracy(done[1].accuracy, done[1].n)).text()


def _name(m: MemberFigures) -> str:
    """A member as a verdict names it: its short key and axis values (`m001 (lr=3e-4)`)."""
    short = member_short(m.member)
    return f"{short} ({m.label})" if m.label else short


def _overlay(members: list[dict], title: str, benchmark: str, dpi: int) -> bytes:
    return plots.sweep_curves_png(members, title=title, benchmark=benchmark, dpi=dpi)


def _by_run(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["run_id"], []).append(r)
    return out


def _whole_benchmarks(evals: dict[str, list[dict]]) -> list[str]:
    names = {r["benchmark"] for rows in evals.values() for r in rows
             if r["metric"] == "accuracy" and "/" not in r["benchmark"]}
    return sorted(names, key=lambda b: (b != HELD_OUT, b))  # the run's own held-out split first


def _figures(row: dict, steps: list[dict], evals: list[dict], run: dict | None,
             outcome: RunOutcome | None) -> MemberFigures:
    axes = json.loads(row["axes"])
    last = sorted((s for s in steps if s.get("reward_mean") is not None), key=lambda s: s["step"])[-LAST_STEPS:]
    own = outcome.primary.benchmark if outcome and outcome.primary else HELD_OUT  # the run's own held-out set
    held = [e for e in evals if e["benchmark"] == own]
    final = max((e["step"] for e in held), default=None)
    pass_rows = [e for e in held if e["step"] == final and e["metric"].startswith("pass@")]
    wall = None
    if run and run.get("ended_at") and run.get("started_at"):
        wall = (run["ended_at"] - run["started_at"]).total_seconds()
    return MemberFigures(
        member=row["member"], axes=axes, label=short_label(axes), status=row["status"], run_id=row["run_id"],
        mlflow_run_id=run.get("mlflow_run_id") if run else None,
        # The run's result from its evals (with n); a member with none yet shows its `sweeps` row's figure.
        accuracy=outcome.accuracy if outcome and outcome.primary else row["final_accuracy"],
        n=outcome.n if outcome and outcome.primary else None,
        others=outcome.others_text() if outcome else "",
        pass_at_k=pass_rows[0]["value"] if pass_rows else None,
        k=int(pass_rows[0]["metric"].removeprefix("pass@")) if pass_rows else None,
        reward=sum(s["reward_mean"] for s in last) / len(last) if last else None,
        steps=max((s["step"] for s in steps), default=0), wall_s=wall,
        checkpoint=run.get("final_checkpoint") if run else None,
        eval_step=outcome.step if outcome and outcome.primary else None,
        benchmark=outcome.primary.benchmark if outcome and outcome.primary else None,
    )
