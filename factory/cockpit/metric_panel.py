"""A run's metric panel: one picture, a grid of small plots of what the trainer records per step (the lake's
`steps` table) by step: train reward and accuracy, loss, KL, entropy, gradient norm, clip fraction, staleness,
response length, tokens/s, the sampler/trainer gap (mean |Δ log-prob| and the k3 KL of the engine's log-probs against
the trainer's own) and what the corrections did with it (shares masked, mean weight).

Every cell is always drawn: a metric that no row of the run records (a column added after the run was trained,
or one a trainer mode does not measure) is a cell that says "not recorded", so a missing curve is never mistaken
for a metric that was left out. Non-finite values (a step skipped for a non-finite loss) are left out of their
line and counted in the cell's title. Rendering follows factory/cockpit/plots.py: Agg canvas, fixed size, deterministic
bytes; the rows are read as `plots` reads them (sorted by step, the latest `recorded_at` wins per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from factory.cockpit.plots import DPI, _by_step, _one_run, _png

# 4 rows of 3 cells at 10 x 9.6 in: 1000 x 960 px at plots.DPI (a page about 1000 px wide shows it whole: MLflow, the
# embedded copy); each cell keeps the 333 x 240 px it had in the 3 x 3 panel before the gap's row was added.
PANEL_WIDTH_IN, PANEL_HEIGHT_IN, COLUMNS = 10.0, 9.6, 3
# The copy drawn inside the Dagster UI's metadata table, whose value column is about 600 px wide on an asset page
# beside its sidebar (a 1600 px window; the full panel scaled down to 750 px was cut off on the right there):
# 576 x 640 px, the same cells on a smaller canvas, so its text stays readable rather than scaled down (as tall per
# row as the 576 x 480 px of the 3 x 3 panel).
INLINE_WIDTH_IN, INLINE_HEIGHT_IN, INLINE_DPI = 7.2, 8.0, 80
NOT_RECORDED = "not recorded"


@dataclass(frozen=True)
class Cell:
    """One small plot of the panel: a title, and the `steps` columns it draws, each with its legend label."""

    title: str
    columns: tuple[tuple[str, str], ...]
    unit_frame: bool = False  # values in [0, 1] on a fixed frame (rewards, accuracies, fractions)


CELLS: tuple[Cell, ...] = (
    Cell("reward / accuracy (train)", (("reward_mean", "reward mean"), ("accuracy", "accuracy")), unit_frame=True),
    Cell("loss", (("loss", "loss"),)),
    Cell("KL to reference", (("kl", "kl"),)),
    Cell("entropy", (("entropy", "entropy"),)),
    Cell("gradient norm", (("grad_norm", "grad norm"),)),
    Cell("clip fraction", (("clip_frac", "clip fraction"),), unit_frame=True),
    Cell("staleness (weight versions)", (("staleness_mean", "mean"), ("staleness_max", "max"))),
    Cell("response length (tokens)", (("response_tokens_mean", "mean"),)),
    Cell("tokens/s", (("tokens_per_s", "generated tokens/s"),)),
    # The engine's log-probs against the trainer's own on the same tokens and weights (not staleness: that is above).
    # The mean |Δ| and the KL apart: the KL is about half the square of the gap, so on one axis it reads as 0.
    Cell("sampler/trainer gap: mean |Δ log-prob|", (("gap_abs_mean", "mean |Δ|"),)),
    Cell("sampler/trainer KL (k3)", (("gap_kl", "KL(sampler || trainer)"),)),
    Cell("correction (TIS / MIS / IcePop)", (("correction_masked_tokens", "tokens masked"),
                                             ("correction_masked_seqs", "sequences masked"),
                                             ("correction_weight_mean", "mean weight")), unit_frame=True),
)


@dataclass(frozen=True)
class CellData:
    """A cell with the run's data: label -> (steps, values), finite values only, in step order; empty when none of
    the cell's columns is recorded by any row."""

    cell: Cell
    series: dict[str, tuple[list[float], list[float]]]
    non_finite: int = 0  # values left out because they were NaN or infinite

    @property
    def recorded(self) -> bool:
        return any(xs for xs, _ in self.series.values())


def panel_data(steps: list[dict]) -> list[CellData]:
    """Every cell of CELLS with the `steps` rows' data (rows of one run; ValueError when they name several)."""
    _one_run(steps, "metric_panel")
    cells = []
    for cell in CELLS:
        series, dropped = {}, 0
        for column, label in cell.columns:
            xs, ys = _by_step(steps, column).get("", ([], []))
            keep = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
            dropped += len(xs) - len(keep)
            if keep:
                series[label] = ([x for x, _ in keep], [y for _, y in keep])
        cells.append(CellData(cell, series, dropped))
    return cells


def metric_panel_png(steps: list[dict], title: str = "", dpi: int = DPI, inline: bool = False) -> bytes:
    """The panel of one run's `steps` rows as a PNG: PANEL_WIDTH_IN x PANEL_HEIGHT_IN inches at `dpi`, or with
    `inline` the copy drawn inside the Dagster UI (INLINE_WIDTH_IN x INLINE_HEIGHT_IN at INLINE_DPI; `dpi` unused).
    ValueError when there are no rows at all (a run that has not trained a step has no panel yet) or the rows
    name more than one run."""
    if inline:
        return _png(_metric_panel_figure(steps, title, (INLINE_WIDTH_IN, INLINE_HEIGHT_IN)), INLINE_DPI)
    return _png(_metric_panel_figure(steps, title), dpi)


def _metric_panel_figure(steps: list[dict], title: str = "",
                         size_in: tuple[float, float] = (PANEL_WIDTH_IN, PANEL_HEIGHT_IN)) -> Figure:
    if not steps:
        raise ValueError("metric_panel_png: no steps rows: the run has not recorded a step yet")
    cells = panel_data(steps)
    fig = Figure(figsize=size_in, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # never a GUI backend
    rows = math.ceil(len(cells) / COLUMNS)
    axes = fig.subplots(rows, COLUMNS, sharex=True, squeeze=False).ravel()
    for ax, data in zip(axes, cells, strict=False):
        name = data.cell.title + (f" ({data.non_finite} non-finite left out)" if data.non_finite else "")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))  # steps are whole numbers
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5))  # a few ticks: a small plot's trend, not its digits
        if not data.recorded:
            ax.text(0.5, 0.5, NOT_RECORDED, ha="center", va="center", transform=ax.transAxes, fontsize=10,
                    alpha=0.6)
            continue
        series = dict(data.series)
        if len(series) == 2 and len({_series_key(xy) for xy in series.values()}) == 1:
            # binary rewards: reward mean and accuracy are the same numbers; one line that says so, not one
            # hidden under the other
            series = {" = ".join(series): next(iter(series.values()))}
        for i, (label, (xs, ys)) in enumerate(series.items()):
            ax.plot(xs, ys, color=f"C{i}", linewidth=1.1, marker="o" if len(xs) < 20 else None, markersize=2.5,
                    label=label)
        if data.cell.unit_frame and all(0.0 <= y <= 1.0 for _, ys in data.series.values() for y in ys):
            ax.set_ylim(-0.03, 1.03)
        if len(data.series) > 1:
            ax.legend(fontsize=7, loc="best", frameon=False)  # also for one line standing for two
    for ax in axes[len(cells):]:
        ax.set_visible(False)
    for ax in axes[-COLUMNS:]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(title or "metrics by step", fontsize=10)
    return fig


def _series_key(xy: tuple[list[float], list[float]]) -> tuple:
    """A series as a hashable value, to tell equal series apart from different ones."""
    return tuple(xy[0]), tuple(xy[1])


__all__ = ["CELLS", "NOT_RECORDED", "Cell", "CellData", "metric_panel_png", "panel_data"]
