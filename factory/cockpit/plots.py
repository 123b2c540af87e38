"""Pictures for the cockpit: small, deterministic PNGs of a run's curves, a run's held-out evals, a
sweep's curves overlaid, and a sweep's summary.

Rendering uses matplotlib's Agg canvas directly (no pyplot, no display, no global backend switch),
at a fixed size and dpi, with no timestamp or software string in the PNG metadata, so the same
rows always give the same bytes (an asset's metadata does not churn between materializations).
Rows come from Iceberg scans in any order, so every series is sorted by step, and when several rows
give the same point (same run, series and step) the one with the latest `recorded_at` wins; rows
without `recorded_at` count as older than any with one, and remaining ties go to the larger value,
so the order of the rows never changes the picture.
Each public `*_png` function builds its Figure in a private `_*_figure` helper (which tests inspect
for line styles, colors and labels) and renders it with `_png`.
`markdown_image` wraps a PNG as a data-URI markdown image, which Dagster's `MetadataValue.md`
renders in the UI and MLflow stores as-is.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from factory.text import PNG_SIGNATURE, markdown_image  # light, for callers without matplotlib; re-exported

WIDTH_IN, HEIGHT_IN, DPI = 6.4, 3.6, 100  # 640 x 360 px: readable in the Dagster sidebar, ~30 KB
# Pictures drawn inside the Dagster UI's metadata table: 448 x 252 px fit its value column beside the key and
# timestamp columns; the same figure, every element scaled. At a 1600 px window that column is about 500 px when the
# longest key has ~22 characters, less with longer keys or a browser's scrollbars (480 px pictures of a sweep summary
# were cut on the right: issue 32); 448 px leave room for keys up to ~29 characters.
INLINE_DPI = 70
# The sweep overlay has two panels and a legend of up to a few dozen members: 640 x 420 px, inline 448 x 294, as
# wide as the other pictures (a 600 px copy was cut on the right).
SWEEP_WIDTH_IN, SWEEP_HEIGHT_IN = 6.4, 4.2
# With the sampler/trainer gap recorded, a second row of two panels (its mean |Δ log-prob| and its k3 KL by step per
# member): 640 x 720 px, inline 448 x 504, as wide as before.
SWEEP_GAP_HEIGHT_IN = 7.2
SWEEP_GAP = (("gap_abs_mean", "sampler/trainer gap: mean |Δ log-prob|"), ("gap_kl", "sampler/trainer KL (k3)"))
# A numeric axis whose positive values span at least this ratio (two decades) is drawn on a log
# scale: learning rates and KL coefficients are swept geometrically.
LOG_SPAN = 100.0
# Axis names (the last dotted part) that are swept geometrically even over less than two decades
# (lr 1e-4 vs 3e-4): their positive values go on a log axis. Names ending in "_lr" count too.
GEOMETRIC_AXES = frozenset({"lr", "learning_rate", "kl_coef", "beta", "weight_decay"})
# A legend below the axes may take at most this share of the figure's height; the curves keep the rest.
LEGEND_MAX_HEIGHT = 0.4

Scale = Literal["linear", "log", "category"]
Series = dict[str, tuple[list[float], list[float]]]  # name -> (steps, values), in step order

# Up to 40 members get distinct (color, linestyle) pairs: ten colors, then the next linestyle.
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")


# -- run curves -----------------------------------------------------------------------------------


def run_curves_png(steps: list[dict], evals: list[dict] | None = None, title: str = "", dpi: int = DPI) -> bytes:
    """One run's training curves and held-out evals in one panel, x = step.

    reward_mean (solid, blue) and training-sample accuracy (dashed, orange, hollow markers) from
    `steps` rows: with binary rewards the two are the same numbers, so they are drawn to stay
    distinguishable on top of each other, and when they are equal at every step the legend says
    "accuracy (train) = reward". Held-out accuracy from `evals` rows (metric == "accuracy";
    benchmarks with a '/' are per-slice breakdowns and are left out) is one line with markers per
    benchmark, joined only within that benchmark. ValueError when there is nothing to draw or the
    rows name more than one run."""
    return _png(_run_curves_figure(steps, evals, title), dpi)


def _run_curves_figure(steps: list[dict], evals: list[dict] | None = None, title: str = "") -> Figure:
    evals = evals or []
    _one_run([*steps, *evals], "run_curves_png")
    reward = _by_step(steps, "reward_mean").get("", ([], []))
    accuracy = _by_step(steps, "accuracy").get("", ([], []))
    points = _by_step(evals, "value", _whole_benchmark_metric("accuracy"))
    if not reward[0] and not accuracy[0] and not points:
        raise ValueError(
            "run_curves_png: nothing to plot: no steps rows with reward_mean or accuracy and no "
            "eval rows with metric 'accuracy'"
        )

    fig, ax = _figure()
    if reward[0]:
        ax.plot(*reward, color="C0", linestyle="-", linewidth=1.8, label="reward mean (train)", zorder=2)
    if accuracy[0]:
        # Dashed and on top, with hollow markers: where it coincides with the reward line both colors
        # still show, alternating along the dashes.
        same = accuracy == reward
        ax.plot(*accuracy, color="C1", linestyle="--", linewidth=1.2, marker="o", markersize=3.5,
                markerfacecolor="none", markevery=_markevery(len(accuracy[0])), zorder=3,
                label="accuracy (train) = reward" if same else "accuracy (train)")
    for i, (bench, xy) in enumerate(points.items()):
        # C0 and C1 are the train curves; benchmarks take the other eight colors.
        ax.plot(*xy, color=f"C{2 + i % 8}", linestyle="-", linewidth=1.0, marker=_MARKERS[i % len(_MARKERS)],
                markersize=4.5, zorder=4, label=f"held-out {bench}")
    _unit_frame(ax, [reward, accuracy, *points.values()])
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    _legend_below(fig, ax.get_lines(), ncol=3)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


# -- held-out evals of one run --------------------------------------------------------------------


def evals_over_steps_png(
    evals: list[dict],
    title: str = "",
    metric: str = "accuracy",
    benchmarks: Sequence[str] | None = None,
    dpi: int = DPI,
) -> bytes:
    """`metric` of one run's held-out evals by training step: one line with markers per benchmark.

    Only rows with `metric` are drawn. Without `benchmarks`, every whole benchmark (per-slice rows,
    benchmarks with a '/', are left out); with it, exactly those benchmarks (a slice named there is
    drawn). The y-axis is the fixed [0, 1] frame when every value lies in it. ValueError when the
    rows come from more than one run (a line never joins two runs) or nothing is left to draw."""
    return _png(_evals_over_steps_figure(evals, title, metric, benchmarks), dpi)


def _evals_over_steps_figure(
    evals: list[dict],
    title: str = "",
    metric: str = "accuracy",
    benchmarks: Sequence[str] | None = None,
) -> Figure:
    run_ids = _one_run(evals, "evals_over_steps_png")
    if benchmarks is None:
        pick = _whole_benchmark_metric(metric)
    else:
        wanted = set(benchmarks)

        def pick(r: Mapping[str, Any]) -> str | None:
            bench = str(r.get("benchmark", ""))
            return bench if r.get("metric") == metric and bench in wanted else None

    series = _by_step(evals, "value", pick)
    if not series:
        which = "whole benchmarks" if benchmarks is None else f"benchmarks {sorted(benchmarks)}"
        raise ValueError(
            f"evals_over_steps_png: nothing to plot: no eval rows with metric {metric!r} on {which} "
            f"({len(evals)} rows given)"
        )

    fig, ax = _figure()
    for i, (bench, xy) in enumerate(series.items()):
        ax.plot(*xy, color=f"C{i % 10}", linestyle=_LINESTYLES[(i // 10) % len(_LINESTYLES)], linewidth=1.2,
                marker=_MARKERS[i % len(_MARKERS)], markersize=4.5, label=bench)
    _unit_frame(ax, series.values())
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(True, alpha=0.3)
    _legend_below(fig, ax.get_lines(), ncol=3)
    run = f": run {run_ids[0]}" if run_ids else ""
    ax.set_title(title or f"held-out {metric} by step{run}", fontsize=10)
    return fig


# -- sweep curves ---------------------------------------------------------------------------------


def sweep_curves_png(members: list[dict], title: str = "", benchmark: str | None = None, dpi: int = DPI) -> bytes:
    """The members of a sweep overlaid, each one run given as {"label", "steps", "evals"} (rows of
    the `steps` and `evals` tables). Left panel: train reward_mean by step; right panel: held-out
    accuracy by step on `benchmark`, or when None on the whole benchmark (no '/') that most members
    have, ties broken alphabetically. When a member's steps recorded the sampler/trainer gap, a second
    row draws it (SWEEP_GAP: mean |Δ log-prob| and the k3 KL by step; SWEEP_GAP_HEIGHT_IN tall). A member
    keeps its color and linestyle in every panel (ten colors, then the next linestyle), in the order
    given; the legend sits below the panels. Members with no rows for a panel are left out of it;
    ValueError when neither the reward nor the accuracy panel has anything, or a member's rows name more
    than one run. SWEEP_WIDTH_IN x SWEEP_HEIGHT_IN inches."""
    return _png(_sweep_curves_figure(members, title, benchmark), dpi)


def _sweep_curves_figure(members: list[dict], title: str = "", benchmark: str | None = None) -> Figure:
    for m in members:
        _one_run([*(m.get("steps") or []), *(m.get("evals") or [])], f"sweep_curves_png: member {m.get('label')!r}")
    if benchmark is None:
        benchmark = _most_common_benchmark(members)
    train = [_by_step(m.get("steps") or [], "reward_mean").get("", ([], [])) for m in members]
    held = [_by_step(m.get("evals") or [], "value", _benchmark_metric(benchmark, "accuracy")).get(benchmark, ([], []))
            if benchmark else ([], []) for m in members]
    if not any(xs for xs, _ in train) and not any(xs for xs, _ in held):
        raise ValueError(
            f"sweep_curves_png: nothing to plot: none of the {len(members)} members has steps rows with "
            f"reward_mean or eval rows with metric 'accuracy'"
            + (f" on benchmark {benchmark!r}" if benchmark else "")
        )

    gaps = [[_by_step(m.get("steps") or [], column).get("", ([], [])) for column, _ in SWEEP_GAP] for m in members]
    with_gap = any(xs for g in gaps for xs, _ in g)
    fig = Figure(figsize=(SWEEP_WIDTH_IN, SWEEP_GAP_HEIGHT_IN if with_gap else SWEEP_HEIGHT_IN), dpi=DPI,
                 layout="constrained")
    FigureCanvasAgg(fig)
    rows = fig.subplots(2 if with_gap else 1, 2, sharex=True, squeeze=False)
    (ax_train, ax_held), gap_axes = rows[0], (list(rows[1]) if with_gap else [])
    handles = []
    for i, (m, t, h, g) in enumerate(zip(members, train, held, gaps, strict=True)):
        if not t[0] and not h[0] and not any(xs for xs, _ in g):
            continue
        style = {"color": f"C{i % 10}", "linestyle": _LINESTYLES[(i // 10) % len(_LINESTYLES)]}
        label = str(m.get("label", f"member {i}"))
        if t[0]:
            ax_train.plot(*t, linewidth=1.1, label=label, **style)
        if h[0]:
            ax_held.plot(*h, linewidth=1.1, marker="o", markersize=3.5, label=label, **style)
        for ax, series in zip(gap_axes, g, strict=False):
            if series[0]:
                ax.plot(*series, linewidth=1.1, label=label, **style)
        # One legend entry per member, drawn as its line style: the panels share it.
        handles.append(Line2D([], [], linewidth=1.1, label=label, **style))
    panels = [(ax_train, "train reward (mean)", train),
              (ax_held, f"held-out accuracy: {benchmark or 'no benchmark'}", held)]
    panels += [(ax, name, [g[j] for g in gaps]) for j, (ax, (_, name)) in enumerate(zip(gap_axes, SWEEP_GAP,
                                                                                       strict=False))]
    for ax, name, series in panels:
        ax.set_title(name, fontsize=9)
        if not with_gap or ax in gap_axes:  # the bottom row's: the rows share their steps
            ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if not any(xs for xs, _ in series):
            ax.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax.transAxes, fontsize=9, alpha=0.6)
        if ax in (ax_train, ax_held):
            _unit_frame(ax, series)
    _legend_below(fig, handles, ncol=4)
    fig.suptitle(title or f"sweep: {len(handles)} of {len(members)} members drawn", fontsize=10)
    return fig


def _most_common_benchmark(members: list[dict]) -> str | None:
    """The whole benchmark with accuracy rows in the most members, ties alphabetical; None if none."""
    count: dict[str, int] = {}
    for m in members:
        for bench in _by_step(m.get("evals") or [], "value", _whole_benchmark_metric("accuracy")):
            count[bench] = count.get(bench, 0) + 1
    return min(count, key=lambda b: (-count[b], b)) if count else None


# -- sweep summary --------------------------------------------------------------------------------


def sweep_summary_png(
    members: list[dict],
    axis: str,
    metric: str = "final_accuracy",
    group_by: list[str] | None = None,
    title: str = "",
    dpi: int = DPI,
) -> bytes:
    """`metric` against the sweep axis `axis` (a dotted spec field name, a key of each member dict).
    Without `group_by`: every member as a point plus a line through the mean per axis value; with
    it: one series (points + mean line) per combination of the `group_by` axes. Numeric axes go on
    a log scale by `axis_scale` (two decades or more, or a learning-rate-like name); other axes are
    categories. Members whose metric is None (failed or unfinished) are skipped; ValueError when
    none is left."""
    return _png(_sweep_summary_figure(members, axis, metric, group_by, title), dpi)


def _sweep_summary_figure(
    members: list[dict],
    axis: str,
    metric: str = "final_accuracy",
    group_by: list[str] | None = None,
    title: str = "",
) -> Figure:
    group_by = list(group_by or [])
    if axis in group_by:
        raise ValueError(f"sweep_summary_png: axis {axis!r} cannot also be in group_by {group_by}")
    done = [m for m in members if m.get(metric) is not None]
    if not done:
        raise ValueError(
            f"sweep_summary_png: no member has a value for metric {metric!r} ({len(members)} members given)"
        )
    raw = [m.get(axis) for m in done]
    scale = axis_scale(raw, axis)
    if scale == "category":
        categories = sorted({str(v) for v in raw})
        xs = [float(categories.index(str(v))) for v in raw]
    else:
        categories = []
        xs = [float(v) for v in raw]

    groups: dict[tuple, list[tuple[float, float]]] = {}
    for m, x in zip(done, xs, strict=True):
        key = tuple(m.get(g) for g in group_by)
        groups.setdefault(key, []).append((x, float(m[metric])))

    fig, ax = _figure()
    for i, key in enumerate(sorted(groups, key=lambda k: tuple(str(v) for v in k))):
        pts = groups[key]
        color = f"C{i % 10}"
        label = ", ".join(f"{g}={v}" for g, v in zip(group_by, key, strict=True))
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, alpha=0.5, color=color,
                   label=None if group_by else "members")
        mx, my = _means(pts)
        # Categories have no order to interpolate along: their means are markers, not a line.
        line = "none" if scale == "category" else "-"
        ax.plot(mx, my, marker="D", markersize=5, linestyle=line, linewidth=1.2, color=color, label=label or "mean")
    if scale == "log":
        ax.set_xscale("log")
        ticks = sorted(set(xs))
        if len(ticks) <= 8:
            # A geometric sweep has a few values: label exactly those, not the decades around them.
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=8)
            ax.minorticks_off()
    elif scale == "category":
        ax.set_xticks(range(len(categories)), categories, fontsize=8)
        ax.set_xlim(-0.5, len(categories) - 0.5)
    ax.set_xlabel(axis)
    ax.set_ylabel(metric)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title or f"{metric} vs {axis} ({len(done)} of {len(members)} members)", fontsize=10)
    return fig


def axis_scale(values: Sequence[Any], name: str | None = None) -> Scale:
    """How to draw an axis with these values: "category" unless every value is a real number
    (bools are categories); "log" when all are positive and either max/min >= LOG_SPAN, or `name`
    looks geometrically swept (its last dotted part is in GEOMETRIC_AXES or ends with "_lr") and
    there are at least two distinct values; else "linear"."""
    if not values or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return "category"
    nums = [float(v) for v in values]
    if not all(math.isfinite(v) for v in nums):
        return "category"
    if min(nums) <= 0:
        return "linear"  # a zero or a negative cannot go on a log axis
    if max(nums) / min(nums) >= LOG_SPAN:
        return "log"
    if name is not None and _is_geometric(name) and len(set(nums)) >= 2:
        return "log"
    return "linear"


def _is_geometric(name: str) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return last in GEOMETRIC_AXES or last.endswith("_lr")


def _means(pts: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    by_x: dict[float, list[float]] = {}
    for x, y in pts:
        by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    return xs, [sum(by_x[x]) / len(by_x[x]) for x in xs]


# -- rows -----------------------------------------------------------------------------------------


def _by_step(
    rows: Iterable[Mapping[str, Any]],
    value_key: str,
    series_of: Callable[[Mapping[str, Any]], str | None] | None = None,
) -> Series:
    """`value_key` by step for each series name `series_of(row)` gives (rows it maps to None are
    left out; without it, one series named ""), sorted by name and step. Rows with no step or no
    value are skipped; of several rows for the same (series, step) the latest wins (module docstring)."""
    best: dict[str, dict[Any, tuple[tuple, float]]] = {}
    for r in rows:
        step, value = r.get("step"), r.get(value_key)
        name = series_of(r) if series_of is not None else ""
        if step is None or value is None or name is None:
            continue
        value = float(value)
        rank = (_recency(r), value if math.isfinite(value) else -math.inf)
        points = best.setdefault(name, {})
        if step not in points or rank > points[step][0]:
            points[step] = (rank, value)
    return {name: (sorted(pts), [pts[s][1] for s in sorted(pts)]) for name, pts in sorted(best.items())}


def _recency(r: Mapping[str, Any]) -> tuple:
    # (0,) sorts before any (1, t): a row without recorded_at is older than every row with one.
    at = r.get("recorded_at")
    return (0,) if at is None else (1, at)


def _whole_benchmark_metric(metric: str) -> Callable[[Mapping[str, Any]], str | None]:
    """Series by benchmark for rows of `metric` on whole benchmarks (a '/' names a per-slice row)."""

    def pick(r: Mapping[str, Any]) -> str | None:
        bench = str(r.get("benchmark", ""))
        return bench if r.get("metric") == metric and "/" not in bench else None

    return pick


def _benchmark_metric(benchmark: str, metric: str) -> Callable[[Mapping[str, Any]], str | None]:
    def pick(r: Mapping[str, Any]) -> str | None:
        return benchmark if r.get("metric") == metric and r.get("benchmark") == benchmark else None

    return pick


def _one_run(rows: Iterable[Mapping[str, Any]], where: str) -> list[str]:
    """The run ids the rows name (rows without one are not counted); ValueError if more than one:
    a line through rows of two runs would draw a curve that no run has."""
    ids = sorted({str(r["run_id"]) for r in rows if r.get("run_id") is not None})
    if len(ids) > 1:
        raise ValueError(f"{where}: rows from {len(ids)} runs ({', '.join(ids)}); give the rows of one run")
    return ids


# -- output ---------------------------------------------------------------------------------------


def _figure() -> tuple[Figure, Any]:
    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # attach the Agg canvas explicitly: never a GUI backend
    return fig, fig.add_subplot()


def _unit_frame(ax: Any, series: Iterable[tuple[list[float], list[float]]]) -> None:
    values = [y for _, ys in series for y in ys if math.isfinite(y)]
    if all(0.0 <= y <= 1.0 for y in values):
        ax.set_ylim(-0.03, 1.03)  # rewards and accuracies of the arithmetic task: a fixed frame compares runs


def _legend_below(fig: Figure, handles: Sequence[Any], ncol: int) -> None:
    """A figure legend below the axes, outside them: a legend inside would cover curves that reach
    every corner of the [0, 1] frame, and constrained layout shrinks the axes to make room. But it
    never shrinks the legend, so the legend has to fit by itself: at most `ncol` columns, no wider
    than the figure and no taller than LEGEND_MAX_HEIGHT of it. The first layout that fits wins,
    trying fewer columns, then a smaller font, then labels cut short (with an ellipsis); the last
    try is kept when none fits. Deterministic: the sizes are measured, not guessed."""
    if not handles:
        return
    renderer = fig.canvas.get_renderer()
    labels = [str(h.get_label()) for h in handles]
    tries = [(cut, size, cols) for cut in (None, 60, 40, 24) for size in (7, 6)
             for cols in range(min(ncol, len(handles)), 0, -1)]
    for i, (cut, size, most) in enumerate(tries):
        # Fewest columns for the same number of rows: 4 entries in 3 columns would leave one alone.
        cols = math.ceil(len(handles) / math.ceil(len(handles) / most))
        shown = [lb if cut is None or len(lb) <= cut else lb[: cut - 1] + "\u2026" for lb in labels]
        legend = fig.legend(list(handles), shown, loc="outside lower center", ncol=cols, fontsize=size,
                            frameon=False)
        box = legend.get_window_extent(renderer)
        if i == len(tries) - 1 or (box.width <= 0.98 * fig.bbox.width
                                   and box.height <= LEGEND_MAX_HEIGHT * fig.bbox.height):
            return
        legend.remove()


def _markevery(n: int) -> int:
    return max(1, n // 20)  # about twenty markers, however long the run


def _png(fig: Figure, dpi: int = DPI) -> bytes:
    buf = io.BytesIO()
    # Software=None drops matplotlib's version string; Agg writes no timestamp for PNG, so equal
    # figures give equal bytes.
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


__all__ = [
    "run_curves_png",
    "evals_over_steps_png",
    "sweep_curves_png",
    "sweep_summary_png",
    "markdown_image",
    "axis_scale",
    "PNG_SIGNATURE",
]
