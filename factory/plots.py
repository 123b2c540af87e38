"""Pictures for the cockpit: small, deterministic PNGs of a run's curves and a sweep's summary.

Rendering uses matplotlib's Agg canvas directly (no pyplot, no display, no global backend switch),
at a fixed size and dpi, with no timestamp or software string in the PNG metadata, so the same
rows always give the same bytes (an asset's metadata does not churn between materializations).
`markdown_image` wraps a PNG as a data-URI markdown image, which Dagster's `MetadataValue.md`
renders in the UI and MLflow stores as-is.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WIDTH_IN, HEIGHT_IN, DPI = 6.4, 3.6, 100  # 640 x 360 px: readable in the Dagster sidebar, ~30 KB
# A numeric axis whose positive values span at least this ratio (two decades) is drawn on a log
# scale: learning rates and KL coefficients are swept geometrically.
LOG_SPAN = 100.0

Scale = Literal["linear", "log", "category"]


# -- run curves -----------------------------------------------------------------------------------


def run_curves_png(steps: list[dict], evals: list[dict] | None = None, title: str = "") -> bytes:
    """reward_mean and training-sample accuracy per step from `steps` rows (the Iceberg `steps`
    table's keys), plus held-out eval accuracy from `evals` rows as one marker series per benchmark
    (metric == "accuracy"; benchmarks with a '/' are per-slice breakdowns and are left out).
    ValueError when there is nothing to draw."""
    rows = sorted((r for r in steps if r.get("step") is not None), key=lambda r: r["step"])
    curves = {key: _xy(rows, key) for key in ("reward_mean", "accuracy")}
    curves = {k: xy for k, xy in curves.items() if xy[0]}
    points = _eval_points(evals or [])
    if not curves and not points:
        raise ValueError(
            "run_curves_png: nothing to plot: no steps rows with reward_mean or accuracy and no "
            "eval rows with metric 'accuracy'"
        )

    fig, ax = _figure()
    labels = {"reward_mean": "reward mean (train)", "accuracy": "accuracy (train samples)"}
    for key, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=labels[key], linewidth=1.2)
    for bench, (xs, ys) in points.items():
        ax.plot(xs, ys, linestyle="none", marker="o", markersize=5, label=f"eval {bench}")
    values = [y for _, ys in [*curves.values(), *points.values()] for y in ys]
    if all(0.0 <= y <= 1.0 for y in values if math.isfinite(y)):
        ax.set_ylim(-0.03, 1.03)  # rewards and accuracies of the arithmetic task: a fixed frame compares runs
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return _png(fig)


def _xy(rows: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        if r.get(key) is not None:
            xs.append(r["step"])
            ys.append(float(r[key]))
    return xs, ys


def _eval_points(evals: Iterable[Mapping[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    by_bench: dict[str, dict[int, float]] = {}
    for r in evals:
        bench = str(r.get("benchmark", ""))
        if r.get("metric") != "accuracy" or "/" in bench or r.get("value") is None or r.get("step") is None:
            continue
        by_bench.setdefault(bench, {})[r["step"]] = float(r["value"])
    return {b: (sorted(pts), [pts[s] for s in sorted(pts)]) for b, pts in sorted(by_bench.items())}


# -- sweep summary --------------------------------------------------------------------------------


def sweep_summary_png(
    members: list[dict],
    axis: str,
    metric: str = "final_accuracy",
    group_by: list[str] | None = None,
    title: str = "",
) -> bytes:
    """`metric` against the sweep axis `axis` (a dotted spec field name, a key of each member dict).
    Without `group_by`: every member as a point plus a line through the mean per axis value; with
    it: one series (points + mean line) per combination of the `group_by` axes. Numeric axes go on
    a log scale when they span two decades or more; other axes are categories. Members whose metric
    is None (failed or unfinished) are skipped; ValueError when none is left."""
    group_by = list(group_by or [])
    if axis in group_by:
        raise ValueError(f"sweep_summary_png: axis {axis!r} cannot also be in group_by {group_by}")
    done = [m for m in members if m.get(metric) is not None]
    if not done:
        raise ValueError(
            f"sweep_summary_png: no member has a value for metric {metric!r} ({len(members)} members given)"
        )
    raw = [m.get(axis) for m in done]
    scale = axis_scale(raw)
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
    elif scale == "category":
        ax.set_xticks(range(len(categories)), categories, fontsize=8)
        ax.set_xlim(-0.5, len(categories) - 0.5)
    ax.set_xlabel(axis)
    ax.set_ylabel(metric)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title(title or f"{metric} vs {axis} ({len(done)} of {len(members)} members)", fontsize=10)
    return _png(fig)


def axis_scale(values: Sequence[Any]) -> Scale:
    """How to draw an axis with these values: "category" unless every value is a real number
    (bools are categories), "log" when all are positive and max/min >= LOG_SPAN, else "linear"."""
    if not values or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return "category"
    nums = [float(v) for v in values]
    if not all(math.isfinite(v) for v in nums):
        return "category"
    if min(nums) > 0 and max(nums) / min(nums) >= LOG_SPAN:
        return "log"
    return "linear"


def _means(pts: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    by_x: dict[float, list[float]] = {}
    for x, y in pts:
        by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    return xs, [sum(by_x[x]) / len(by_x[x]) for x in xs]


# -- output ---------------------------------------------------------------------------------------


def markdown_image(png: bytes, alt: str) -> str:
    """A markdown image with the PNG inlined as a base64 data URI."""
    if not png.startswith(PNG_SIGNATURE):
        raise ValueError("markdown_image: the bytes are not a PNG")
    # Brackets and newlines in the alt text would end the markdown image early.
    safe_alt = " ".join(alt.replace("[", "(").replace("]", ")").split())
    return f"![{safe_alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


def _figure() -> tuple[Figure, Any]:
    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # attach the Agg canvas explicitly: never a GUI backend
    return fig, fig.add_subplot()


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    # Software=None drops matplotlib's version string; Agg writes no timestamp for PNG, so equal
    # figures give equal bytes.
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


__all__ = ["run_curves_png", "sweep_summary_png", "markdown_image", "axis_scale", "PNG_SIGNATURE"]
