"""A spec's blend played forward, without training: realized vs target share of each source along the stream.

`blend_report(spec, sources)` builds the spec's Blender (its schedule and seed), draws `prompts_per_step`
prompts per step for the spec's steps (saying each step, so a schedule's segments show) and records, per
source, the cumulative realized share and the cumulative target share (the weights in force at each draw,
summed) after every step, and the largest quota error: max over every prefix of a constant-weight segment of
|served - weight * draws| (the blender keeps it below one prompt). `png()` draws it, realized solid and target
dashed in the same color, in the cockpit's deterministic style (factory/cockpit/plots.py).

What it does not show: an online curriculum or the offline pass-rate filter (they act on rewards and on the
lake while a run trains), so with `data.curriculum` or `data.filter` set this is the blend they start from.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from factory.cockpit.plots import DPI, HEIGHT_IN, WIDTH_IN
from factory.config import ExperimentSpec
from factory.data.from_spec import blender_for
from factory.data.sources.base import PromptSource

MAX_POINTS = 400  # points per curve: a long run's curve is sampled, its last step always kept


@dataclass(frozen=True)
class SourceShare:
    name: str
    target: float  # target share over the whole stream (the weights in force at each draw, averaged)
    realized: float  # share of the draws it served
    draws: int
    max_quota_error: float  # max |served - weight * draws| over every prefix of every segment


@dataclass(frozen=True)
class BlendReport:
    steps: int
    prompts_per_step: int
    draws: int
    sources: list[SourceShare]
    # after each sampled step: the step, and per source the cumulative realized and target shares
    at_steps: list[int] = field(default_factory=list)
    realized: dict[str, list[float]] = field(default_factory=dict)
    target: dict[str, list[float]] = field(default_factory=dict)

    @property
    def max_quota_error(self) -> float:
        return max(s.max_quota_error for s in self.sources)

    def png(self, dpi: int = DPI, title: str = "") -> bytes:
        """Cumulative realized (solid) vs target (dashed) share of each source by step."""
        fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        colors = [f"C{i % 10}" for i in range(len(self.sources))]
        for s, color in zip(self.sources, colors, strict=True):
            ax.plot(self.at_steps, self.realized[s.name], color=color, linestyle="-",
                    label=f"{s.name} realized {s.realized:.3f}")
            ax.plot(self.at_steps, self.target[s.name], color=color, linestyle="--", linewidth=1.0,
                    label=f"{s.name} target {s.target:.3f}")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("step")
        ax.set_ylabel("cumulative share of prompts")
        ax.set_title(title or f"blend: {self.draws} draws, max quota error {self.max_quota_error:.2f} prompts",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False, ncol=2 if len(self.sources) > 3 else 1)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})  # equal reports, equal bytes
        return buf.getvalue()


def _sampled(steps: int) -> set[int]:
    every = max(1, -(-steps // MAX_POINTS))
    return {s for s in range(steps) if s % every == 0} | {steps - 1}


def blend_report(spec: ExperimentSpec, sources: Sequence[PromptSource], steps: int | None = None,
                 prompts_per_step: int | None = None) -> BlendReport:
    """Play the spec's blend over `steps` (default: schedule.steps) x `prompts_per_step` (default: the rollout's)
    draws from `sources` (what `factory.data.from_spec.open_sources(spec.resolved.blend, ...)` opened)."""
    steps = spec.schedule.steps if steps is None else steps
    per_step = spec.rollout.prompts_per_step if prompts_per_step is None else prompts_per_step
    if steps < 1 or per_step < 1:
        raise ValueError(f"blend_report: steps and prompts_per_step must be >= 1, got {steps} and {per_step}")
    blender = blender_for(spec.resolved.blend, sources)
    names = blender.names
    index = blender.index
    n = len(names)
    served, target = [0] * n, [0.0] * n
    seg_served, seg_t, seg_start = [0] * n, 0, None
    worst = [0.0] * n
    keep = _sampled(steps)
    at_steps: list[int] = []
    realized_at: dict[str, list[float]] = {name: [] for name in names}
    target_at: dict[str, list[float]] = {name: [] for name in names}
    draws = 0
    for step in range(steps):
        blender.set_step(step)
        if blender.segment != seg_start:  # the blender's quotas start over in a new segment: so do ours
            seg_start, seg_served, seg_t = blender.segment, [0] * n, 0
        weights = blender.schedule[blender.segment]
        for _, problem in blender.take_many(per_step):
            i = index[problem.meta["source"]]
            served[i] += 1
            seg_served[i] += 1
            seg_t += 1
            draws += 1
            for j in range(n):
                target[j] += weights[j]
                err = abs(seg_served[j] - weights[j] * seg_t)
                if err > worst[j]:
                    worst[j] = err
        if step in keep:
            at_steps.append(step)
            for j, name in enumerate(names):
                realized_at[name].append(served[j] / draws)
                target_at[name].append(target[j] / draws)
    shares = [SourceShare(name, target[j] / draws, served[j] / draws, served[j], worst[j])
              for j, name in enumerate(names)]
    return BlendReport(steps, per_step, draws, shares, at_steps, realized_at, target_at)
