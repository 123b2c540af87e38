"""The prompt feed: what a rollout producer draws prompts from, the blender and the curriculum together.

`draw(step)` takes the blend's next prompt and asks the curriculum whether to generate it; a skipped prompt
is done at once (it costs no rollout) and the next one is taken. `trained(groups)` tells both that these
groups were trained: the blender will not serve their draws again, the curriculum learns from their
rewards (and may move the blend's weights: a level curriculum). `dropped(draws)` marks draws that left
without training (too stale); they are not served again either, as with any other consumer of the blender.

`state_dict()` holds the blender's and the curriculum's state, plus `next` (draws made) and `pending`
(draws in flight: drawn, not yet trained or dropped). After `load_state_dict(state, buffered)` the pending
draws are served again before any new one, except `buffered` ones (restored into the rollout buffer), so a
resumed run trains exactly the prompts of an uninterrupted one: none twice, none skipped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from factory.config import Blend
from factory.data.blender import Blender
from factory.data.curriculum import make_curriculum
from factory.data.from_spec import blender_for, open_sources
from factory.data.sources.base import ListSource, PromptSource
from factory.problem import Problem


class PromptFeed:
    """A blender and an optional curriculum behind the producer's draw / trained / dropped calls."""

    def __init__(self, blender: Blender, curriculum=None):
        self.blender, self.curriculum = blender, curriculum
        self._lock = threading.Lock()
        self._problems: dict[int, Problem] = {}  # draws in flight -> their problem (for the curriculum)
        self._admitted: set[int] = set()  # draws in flight at a resume point: admitted then, not judged again
        self._skipped = {n: 0 for n in blender.names}  # since the last `report()`
        self._skipped_total = 0
        # A curriculum that refuses everything must not spin forever: after this many skips in a row the next
        # prompt is generated anyway (counted).
        self._max_skips = max(64, blender.total_rows)
        self._forced = 0

    @property
    def names(self) -> list[str]:
        return self.blender.names

    def draw(self, step: int) -> tuple[int, Problem]:
        """The next prompt to generate for training step `step` (0-based) and its draw id."""
        with self._lock:
            skips = 0
            while True:
                k, problem = self.blender.take(step=step)
                source = problem.meta.get("source", self.names[0])
                if k in self._admitted:
                    self._admitted.discard(k)
                    break
                if self.curriculum is None or self.curriculum.admit(k, source, problem):
                    break
                if skips >= self._max_skips:
                    self._forced += 1
                    break
                self.blender.done([k])
                self._skipped[source] += 1
                self._skipped_total += 1
                skips += 1
            self._problems[k] = problem
            return k, problem

    def trained(self, groups: Iterable[Any]) -> None:
        """These groups (with `meta["draw"]` and their samples' rewards) were trained (or judged and filtered)."""
        groups = list(groups)
        with self._lock:
            self.blender.done([g.meta["draw"] for g in groups])
            for g in groups:
                problem = self._problems.pop(g.meta["draw"], None)
                if self.curriculum is not None and problem is not None:
                    self.curriculum.observe(problem.meta.get("source", self.names[0]), problem,
                                            [s.reward for s in g.samples])
            if self.curriculum is not None and (w := self.curriculum.weights()) is not None:
                self.blender.set_weights(w)

    def dropped(self, draws: Iterable[int]) -> None:
        """Draws that left without training (e.g. rejected as stale): done, not learned from."""
        draws = list(draws)
        with self._lock:
            self.blender.done(draws)
            for k in draws:
                self._problems.pop(k, None)

    def skip(self, n: int) -> None:
        """Start `n` draws further on (a run continued from step N without a resume point)."""
        with self._lock:
            for _ in range(n):
                k, _ = self.blender.take()
                self.blender.done([k])

    def report(self) -> dict[str, dict[str, float]]:
        """Per source since the last call: prompts the curriculum skipped, and the blend's weight now."""
        with self._lock:
            weights = self.blender.weights()
            out = {n: {"skipped": self._skipped[n], "target_share": weights[n]} for n in self.names}
            self._skipped = dict.fromkeys(self.names, 0)
            return out

    def metrics(self) -> dict[str, float]:
        with self._lock:
            m = {"data/skipped": float(self._skipped_total), "data/forced": float(self._forced)}
            if self.curriculum is not None:
                m.update(self.curriculum.metrics())
            return m

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            blend = self.blender.state_dict()
            return {"next": blend["next_draw"], "pending": sorted(d for d, *_ in blend["in_flight"]),
                    "blender": blend, "skipped": self._skipped_total, "forced": self._forced,
                    "curriculum": None if self.curriculum is None else self.curriculum.state_dict()}

    def load_state_dict(self, state: dict[str, Any], buffered: Iterable[int] = ()) -> None:
        """Continue at `state`; `buffered` draws are back in the rollout buffer (pending, not served again)."""
        with self._lock:
            if self._problems or self.blender.in_flight():
                raise ValueError("PromptFeed.load_state_dict needs a fresh feed (draws were already made)")
            if (state.get("curriculum") is None) != (self.curriculum is None):
                raise ValueError("prompt feed state: the resume point was taken with"
                                 + ("out" if state.get("curriculum") is None else "") + " a curriculum, this run has"
                                 + (" one" if self.curriculum is not None else " none") + " (data.curriculum changed)")
            keep = set(buffered)
            self.blender.load_state_dict(state["blender"], keep=keep)
            self._admitted = {d for d, *_ in state["blender"]["in_flight"]} - keep
            for k in keep:
                self._problems[k] = self.blender.problem_of(k)
            if self.curriculum is not None:
                self.curriculum.load_state_dict(state["curriculum"])
            self._skipped_total, self._forced = int(state.get("skipped", 0)), int(state.get("forced", 0))


def make_feed(blend: Blend, train: list[Problem] | None = None, sources: list[PromptSource] | None = None,
              stats: dict[tuple[str, str], tuple[int, int]] | None = None) -> PromptFeed:
    """The feed of `blend` (a spec's `spec.resolved.blend`: its `data`, else the task's training split `train`)
    and its curriculum; `stats` are the offline per-prompt (samples, passes) the `data.filter` reads
    (factory/data/stats.py)."""
    sources = sources if sources is not None else open_sources(blend, train)
    blender = blender_for(blend, sources)
    curriculum = None
    d = blend.data
    if d is not None and (d.curriculum.kind != "none" or d.filter is not None):
        curriculum = make_curriculum(d.curriculum, sources=blender.names, seed=blend.seed,
                                     base_weights=blend.schedule()[0], prompt_filter=d.filter, stats=stats)
        if (w := curriculum.weights()) is not None:
            blender.set_weights(w)
    return PromptFeed(blender, curriculum)


def feed_of(problems: list[Problem], seed: int = 0, name: str = "problems") -> PromptFeed:
    """A feed over an in-memory list of problems with no curriculum (tests, benchmarks)."""
    rows = [Problem(p.id, p.prompt, p.answer, p.op, p.digits, {**p.meta, "source": name}) for p in problems]
    return PromptFeed(Blender([ListSource(name, rows, f"{name}-{len(rows)}")], weights={name: 1.0}, seed=seed))
