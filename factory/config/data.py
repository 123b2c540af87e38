"""The `data` section: GRPO's prompt blend (sources, weights or a schedule), its curriculum and offline filter."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from factory.config.bounds import MAX_HELD_OUT
from factory.config.section import _Section
from factory.source_spec import Seed, SourceError, parse_source_spec


class CurriculumSpec(_Section):
    """Where rollouts are spent, from the rewards of trained groups (factory/data/curriculum.py).

    none: every prompt the blend serves is generated. online: a prompt is dropped once its last `attempts`
    groups were all solved (every sample right) or all unsolved (none right), per `drop`, and served again
    after `retry_after` further draws (0: never). priority: a prompt seen before is generated with
    probability max(floor, 4 p (1 - p)) (p: its pass rate so far), so prompts near p = 0.5, where a group's
    advantages carry most signal, are preferred; unseen prompts always are. level: `levels` are source names,
    easiest first; the blend's weight sits on the current level (earlier ones keep `review` of it) and moves
    to the next once the level's accuracy over its last `window` groups reaches `threshold`."""

    kind: Literal["none", "online", "priority", "level"] = "none"
    attempts: int = Field(1, ge=1, description="online: groups of a prompt judged before it may be dropped")
    drop: Literal["solved", "unsolved", "both"] = Field("both", description="online: which prompts are dropped")
    retry_after: int = Field(0, ge=0, description="online: draws after which a dropped prompt is served again; "
                             "0: never")
    floor: float = Field(0.05, gt=0, le=1, description="priority: least probability of generating a seen prompt")
    levels: list[str] = Field(default_factory=list, description="level: source names, easiest first")
    threshold: float = Field(0.8, gt=0, le=1, description="level: rolling accuracy that moves to the next level")
    window: int = Field(32, ge=1, description="level: groups in a level's rolling accuracy")
    review: float = Field(0.0, ge=0, lt=1, description="level: share of draws kept on the levels already passed")


class PromptFilterSpec(_Section):
    """Offline curriculum: prompts whose pass rate over earlier runs (the lake's `prompt_stats`) lies outside
    [min_pass_rate, max_pass_rate] are skipped; prompts with fewer than `min_attempts` recorded samples
    are kept (nothing is known about them)."""

    min_pass_rate: float = Field(0.0, ge=0, le=1)
    max_pass_rate: float = Field(1.0, ge=0, le=1)
    min_attempts: int = Field(8, ge=1, description="samples recorded before a prompt's pass rate is trusted")

    @model_validator(mode="after")
    def _window(self) -> PromptFilterSpec:
        if self.min_pass_rate > self.max_pass_rate:
            raise ValueError(f"min_pass_rate {self.min_pass_rate} must be <= max_pass_rate {self.max_pass_rate}")
        return self


class DataSpec(_Section):
    """The prompts GRPO trains on: a blend of sources (factory/data/), with fixed weights or a schedule over
    steps, and a curriculum. Without a `data` section a run blends one source, the task's training split.
    The SFT warm start and the `heldout` benchmark stay the task's; each generated source adds its own
    held-out benchmark (`source:<name>`, the `held_out` problems after its training rows)."""

    sources: list[dict[str, Any]] = Field(min_length=1, description="source specs (factory/source_spec.py)")
    weights: dict[str, float] | None = Field(None, description="source -> weight (normalized); unset and no "
                                             "schedule: equal weights")
    schedule: dict[int, dict[str, float]] | None = Field(
        None, description="step -> {source: weight}: the weights from that training step on (first at step 0)")
    seed: Seed | None = Field(None, description="the blend's shuffle seed; unset: the spec's seed")
    curriculum: CurriculumSpec = Field(default_factory=CurriculumSpec)
    filter: PromptFilterSpec | None = Field(None, description="offline: skip prompts by their recorded pass rate")
    held_out: int = Field(100, ge=0, le=MAX_HELD_OUT, description="held-out problems per generated source: arithmetic, "
                          "reasoning_gym, humaneval (0: none)")

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out, seen = [], set()
        for i, raw in enumerate(v):
            try:
                spec = parse_source_spec(raw)
            except SourceError as e:
                raise ValueError(f"entry {i}: {e}") from None
            if spec.name in seen:
                raise ValueError(f"entry {i}: source name {spec.name!r} is used twice")
            seen.add(spec.name)
            out.append(spec.model_dump(mode="json"))
        return out

    def names(self) -> list[str]:
        return [s["name"] for s in self.sources]

    def blend_weights(self) -> dict[int, dict[str, float]]:
        """The schedule the blender follows: step -> weights (fixed weights are the schedule {0: weights})."""
        if self.schedule is not None:
            return {int(k): dict(v) for k, v in self.schedule.items()}
        return {0: dict(self.weights) if self.weights is not None else {n: 1.0 for n in self.names()}}

    @model_validator(mode="after")
    def _consistent(self) -> DataSpec:
        names = self.names()
        if self.weights is not None and self.schedule is not None:
            raise ValueError("weights and schedule: give one (fixed weights are the schedule {0: weights})")
        entries = ([("weights", self.weights)] if self.weights is not None else
                   [(f"schedule.{k}", w) for k, w in sorted((self.schedule or {}).items())])
        for where, weights in entries:
            unknown = sorted(set(weights) - set(names))
            if unknown:
                raise ValueError(f"{where}: unknown source(s) {unknown} (sources: {names})")
            bad = {n: w for n, w in weights.items() if w < 0}
            if bad:
                raise ValueError(f"{where}: weights must be >= 0, got {bad}")
            if sum(weights.values()) <= 0:
                raise ValueError(f"{where}: all weights are 0 (at least one source must be drawn)")
        if self.schedule is not None:
            if any(k < 0 for k in self.schedule):
                raise ValueError(f"schedule: steps must be >= 0, got {sorted(self.schedule)}")
            if 0 not in self.schedule:
                raise ValueError(f"schedule: the first entry must be step 0 (weights from the start), got steps "
                                 f"{sorted(self.schedule)}")
        c = self.curriculum
        if c.kind == "level":
            if not c.levels:
                raise ValueError("curriculum.levels: a level curriculum needs the source names, easiest first")
            unknown = sorted(set(c.levels) - set(names))
            if unknown:
                raise ValueError(f"curriculum.levels: unknown source(s) {unknown} (sources: {names})")
            if len(set(c.levels)) != len(c.levels):
                raise ValueError(f"curriculum.levels: a source is listed twice: {c.levels}")
            if self.schedule is not None:
                raise ValueError("curriculum: a level curriculum sets the weights itself; drop data.schedule")
        elif c.levels:
            raise ValueError(f"curriculum.levels: only used by kind 'level', got kind {c.kind!r}")
        return self
