"""The curriculum: which served prompts get rollouts, and (level kind) the blend weights, from trained groups.

It owns the per-prompt and per-source memory of rewards and the decisions made from it; the blender
(factory/data/blender.py) owns the stream and the feed (factory/data/feed.py) wires the two. Every prompt is
keyed by `source + "/" + problem.id`; a sample is solved when its reward is >= 1.

- offline filter (`PromptFilterSpec` + `stats`, composes with every kind and is checked first): a prompt with
  at least `min_attempts` recorded samples and a pass rate outside [min_pass_rate, max_pass_rate] is skipped.
  `stats` None: nothing is known, nothing is filtered.
- none: every prompt is admitted.
- online: a prompt whose last `attempts` judged groups were all solved (drop solved/both) or all unsolved
  (drop unsolved/both) is skipped. The draw id of its first refusal is its drop time; with retry_after > 0 it
  is admitted again at the first draw id >= drop time + retry_after, and its judgements start over.
- priority: a prompt seen before is admitted with probability max(floor, 4p(1-p)), p its samples' pass rate
  so far; the uniform draw is a hash of (seed, draw id), so a resumed or multi-threaded run decides alike.
- level: the blend weight sits on `levels[i]` (1 - review; the passed levels share `review`), everything
  else gets 0; level i is passed once its last `window` groups' mean accuracy reaches `threshold`.

`state_dict()` is JSON (str keys) and holds everything a fresh object needs to make the same decisions.
All public methods hold one lock: producer threads admit while the trainer observes.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from factory.config import CurriculumSpec, PromptFilterSpec
from factory.data.shuffle import mix64, name_key
from factory.problem import Problem

STATE_FORMAT = 1
Stats = Mapping[tuple[str, str], tuple[int, int]]  # (source, prompt id) -> (samples, passes) over earlier runs

_PRIORITY_DOMAIN = name_key("factory.curriculum.priority")  # keeps these draws apart from the blender's shuffle


def _uniform(seed: int, draw_id: int) -> float:
    """A deterministic uniform in [0, 1) for one draw."""
    return (mix64(seed, _PRIORITY_DOMAIN, draw_id) >> 11) * (1.0 / (1 << 53))


def _bad_state(why: str) -> ValueError:
    return ValueError(f"curriculum state: {why}")


class Curriculum:
    """kind none, and what every kind shares: the offline filter, argument checks, counters, the lock."""

    kind = "none"

    def __init__(self, spec: CurriculumSpec, sources: Sequence[str], seed: int = 0,
                 base_weights: Mapping[str, float] | None = None, prompt_filter: PromptFilterSpec | None = None,
                 stats: Stats | None = None):
        self.spec = spec
        self.sources = list(sources)
        self.seed = seed
        self.base_weights = dict(base_weights) if base_weights is not None else None
        self.prompt_filter = prompt_filter
        self._offline_skip = _offline_skips(prompt_filter, stats, set(self.sources))
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {"admitted": 0, "skipped": 0, "filtered_offline": 0, "observed": 0}
        self._skipped_by_source = dict.fromkeys(self.sources, 0)
        self._known = frozenset(self.sources)

    # -- the public surface (locked, checked) ----------------------------------------------------------------

    def admit(self, draw_id: int, source: str, problem: Problem) -> bool:
        """Whether to generate this served prompt now (False: skip it; the feed marks the draw done)."""
        if isinstance(draw_id, bool) or not isinstance(draw_id, int) or draw_id < 0:
            raise ValueError(f"curriculum.admit: draw_id must be an int >= 0, got {draw_id!r}")
        self._check_source("admit", source)
        key = f"{source}/{problem.id}"
        with self._lock:
            if key in self._offline_skip:
                reason: str | None = "filtered_offline"
            else:
                reason = self._decide(draw_id, source, key)
            if reason is None:
                self._counts["admitted"] += 1
                return True
            self._counts["skipped"] += 1
            self._counts[reason] = self._counts.get(reason, 0) + 1
            self._skipped_by_source[source] += 1
            return False

    def observe(self, source: str, problem: Problem, rewards: Sequence[float]) -> None:
        """A trained group's rewards (one per sample)."""
        self._check_source("observe", source)
        rewards = list(rewards)
        if not rewards:
            raise ValueError(f"curriculum.observe: empty reward list for {source}/{problem.id} "
                             f"(expected one reward per sample of the group)")
        for r in rewards:
            if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r):
                raise ValueError(f"curriculum.observe: rewards of {source}/{problem.id} must be finite numbers, "
                                 f"got {r!r}")
        passes = sum(1 for r in rewards if r >= 1)
        with self._lock:
            self._counts["observed"] += 1
            self._observe(source, f"{source}/{problem.id}", passes, len(rewards))

    def weights(self) -> dict[str, float] | None:
        """The blend weights wanted now (level kind); None: the blend's own weights stand."""
        return None

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"format": STATE_FORMAT, "kind": self.kind, "sources": list(self.sources), "seed": self.seed,
                    "counts": dict(self._counts), "skipped_by_source": dict(self._skipped_by_source),
                    **self._state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`: same kind and sources (and seed, for priority); the spec's numbers may change."""
        if not isinstance(state, Mapping):
            raise _bad_state(f"expected a dict, got {type(state).__name__}")
        if state.get("format") != STATE_FORMAT:
            raise _bad_state(f"format {state.get('format')!r}, expected {STATE_FORMAT}")
        if state.get("kind") != self.kind:
            raise _bad_state(f"saved by a {state.get('kind')!r} curriculum, this one is {self.kind!r}")
        if state.get("sources") != self.sources:
            raise _bad_state(f"sources {state.get('sources')!r} differ from this curriculum's {self.sources}")
        try:
            counts = {str(k): int(v) for k, v in state["counts"].items()}
            by_source = {s: int(state["skipped_by_source"][s]) for s in self.sources}
            with self._lock:
                self._load(state)
                self._counts.update(counts)
                self._skipped_by_source = by_source
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise _bad_state(f"malformed ({type(e).__name__}: {e})") from None

    def metrics(self) -> dict[str, float]:
        """Counters since the run began (skips by reason, per source) and the kind's own gauges."""
        with self._lock:
            out = {f"curriculum/{k}": float(v) for k, v in self._counts.items()}
            out.update({f"curriculum/skipped/{s}": float(n) for s, n in self._skipped_by_source.items()})
            if self.prompt_filter is not None:
                out["curriculum/filter_prompts"] = float(len(self._offline_skip))
            out.update(self._metrics())
            return out

    def _check_source(self, where: str, source: str) -> None:
        if source not in self._known:
            raise ValueError(f"curriculum.{where}: unknown source {source!r} (sources: {self.sources})")

    # -- what a kind overrides (called under the lock) -------------------------------------------------------

    def _decide(self, draw_id: int, source: str, key: str) -> str | None:
        """None: admit; else the reason it is skipped (a counter name)."""
        return None

    def _observe(self, source: str, key: str, passes: int, samples: int) -> None:
        pass

    def _state(self) -> dict[str, Any]:
        return {}

    def _load(self, state: Mapping[str, Any]) -> None:
        pass

    def _metrics(self) -> dict[str, float]:
        return {}


def _offline_skips(prompt_filter: PromptFilterSpec | None, stats: Stats | None, sources: set[str]) -> set[str]:
    """The keys the offline filter skips. Entries of sources outside this blend are ignored (other runs')."""
    if prompt_filter is None or stats is None:
        return set()
    f = prompt_filter
    out = set()
    for k, v in stats.items():
        if not (isinstance(k, tuple) and len(k) == 2):
            raise ValueError(f"curriculum stats: key {k!r} must be (source, prompt id)")
        try:
            attempts, passes = (operator.index(x) for x in v)
        except (TypeError, ValueError):
            raise ValueError(f"curriculum stats {k!r}: expected (attempts, passes) ints, got {v!r}") from None
        if not 0 <= passes <= attempts:
            raise ValueError(f"curriculum stats {k!r}: expected ints 0 <= passes <= attempts, got {v!r}")
        if k[0] in sources and attempts >= f.min_attempts and attempts > 0:
            rate = passes / attempts
            if not f.min_pass_rate <= rate <= f.max_pass_rate:
                out.add(f"{k[0]}/{k[1]}")
    return out


class OnlineCurriculum(Curriculum):
    """kind online: per prompt [run, dropped_at]. run > 0: its last `run` groups were solved, < 0: unsolved
    (|run| capped at `attempts`); a mixed group resets it to 0. dropped_at: the draw id of its first refusal,
    -1 while not refused. A prompt with run 0 and no drop is forgotten (it decides like an unseen one)."""

    kind = "online"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._prompts: dict[str, list[int]] = {}
        for k in ("dropped_solved", "dropped_unsolved", "retried"):
            self._counts[k] = 0

    def _droppable(self, run: int) -> str | None:
        a, drop = self.spec.attempts, self.spec.drop
        if run >= a and drop in ("solved", "both"):
            return "dropped_solved"
        if run <= -a and drop in ("unsolved", "both"):
            return "dropped_unsolved"
        return None

    def _decide(self, draw_id: int, source: str, key: str) -> str | None:
        st = self._prompts.get(key)
        if st is None:
            return None
        reason = self._droppable(st[0])
        if reason is None:
            return None
        if st[1] < 0:
            st[1] = draw_id
        elif self.spec.retry_after > 0 and draw_id - st[1] >= self.spec.retry_after:
            del self._prompts[key]  # served again; `attempts` new judgements before it can be dropped again
            self._counts["retried"] += 1
            return None
        return reason

    def _observe(self, source: str, key: str, passes: int, samples: int) -> None:
        st = self._prompts.get(key)
        run = st[0] if st is not None else 0
        a = self.spec.attempts
        if passes == samples:
            run = min(a, run + 1) if run > 0 else 1
        elif passes == 0:
            run = max(-a, run - 1) if run < 0 else -1
        else:
            run = 0
        if self._droppable(run) is None:
            if run == 0:
                self._prompts.pop(key, None)
            else:
                self._prompts[key] = [run, -1]
        elif st is None:
            self._prompts[key] = [run, -1]
        else:
            st[0] = run  # a drop already in force keeps its time

    def _state(self) -> dict[str, Any]:
        return {"prompts": {k: list(v) for k, v in self._prompts.items()}}

    def _load(self, state: Mapping[str, Any]) -> None:
        prompts = {}
        for k, v in state["prompts"].items():
            if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)):
                raise _bad_state(f"prompt {k!r}: expected [run, dropped_at], got {v!r}")
            prompts[str(k)] = list(v)
        self._prompts = prompts

    def _metrics(self) -> dict[str, float]:
        dropped = sum(1 for run, _ in self._prompts.values() if self._droppable(run) is not None)
        return {"curriculum/prompts_dropped": float(dropped)}


class PriorityCurriculum(Curriculum):
    """kind priority: per prompt [samples, passes] over its trained groups."""

    kind = "priority"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._prompts: dict[str, list[int]] = {}
        self._counts["skipped_priority"] = 0

    def accept_probability(self, samples: int, passes: int) -> float:
        p = passes / samples
        return max(self.spec.floor, 4.0 * p * (1.0 - p))

    def _decide(self, draw_id: int, source: str, key: str) -> str | None:
        st = self._prompts.get(key)
        if st is None:
            return None
        return None if _uniform(self.seed, draw_id) < self.accept_probability(*st) else "skipped_priority"

    def _observe(self, source: str, key: str, passes: int, samples: int) -> None:
        st = self._prompts.setdefault(key, [0, 0])
        st[0] += samples
        st[1] += passes

    def _state(self) -> dict[str, Any]:
        return {"prompts": {k: list(v) for k, v in self._prompts.items()}}

    def _load(self, state: Mapping[str, Any]) -> None:
        if state.get("seed") != self.seed:
            raise _bad_state(f"seed {state.get('seed')!r} differs from this curriculum's {self.seed} "
                             f"(priority draws would differ from the run's)")
        prompts = {}
        for k, v in state["prompts"].items():
            if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v)
                    and 0 <= v[1] <= v[0] and v[0] > 0):
                raise _bad_state(f"prompt {k!r}: expected [samples, passes] with 0 <= passes <= samples, got {v!r}")
            prompts[str(k)] = list(v)
        self._prompts = prompts

    def _metrics(self) -> dict[str, float]:
        return {"curriculum/prompts_seen": float(len(self._prompts))}


class LevelCurriculum(Curriculum):
    """kind level: the current level index and, per source, its last `window` groups' accuracies."""

    kind = "level"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        levels = list(self.spec.levels)
        if not levels:
            raise ValueError("curriculum.levels: a level curriculum needs the source names, easiest first")
        unknown = [s for s in levels if s not in self.sources]
        if unknown:
            raise ValueError(f"curriculum.levels: unknown source(s) {unknown} (sources: {self.sources})")
        if len(set(levels)) != len(levels):
            raise ValueError(f"curriculum.levels: a source is listed twice: {levels}")
        self.levels = levels
        self.level = 0
        self._windows: dict[str, deque[float]] = {s: deque(maxlen=self.spec.window) for s in self.sources}

    def accuracy(self, source: str) -> float | None:
        w = self._windows[source]
        return sum(w) / len(w) if w else None

    def weights(self) -> dict[str, float]:
        with self._lock:
            out = dict.fromkeys(self.sources, 0.0)
            passed = self.levels[:self.level]
            if not passed:
                out[self.levels[self.level]] = 1.0
                return out
            out[self.levels[self.level]] = 1.0 - self.spec.review
            for s in passed:
                out[s] = self.spec.review / len(passed)
            return out

    def _advance(self) -> None:
        # a later level may already have a full window (groups in flight, or a resume): pass it as well
        while self.level < len(self.levels) - 1:
            w = self._windows[self.levels[self.level]]
            if len(w) < self.spec.window or sum(w) / len(w) < self.spec.threshold:
                return
            self.level += 1

    def _observe(self, source: str, key: str, passes: int, samples: int) -> None:
        self._windows[source].append(passes / samples)
        self._advance()

    def _state(self) -> dict[str, Any]:
        return {"levels": list(self.levels), "level": self.level,
                "windows": {s: list(w) for s, w in self._windows.items()}}

    def _load(self, state: Mapping[str, Any]) -> None:
        if state["levels"] != self.levels:
            raise _bad_state(f"levels {state['levels']!r} differ from this curriculum's {self.levels}")
        level = state["level"]
        if not (isinstance(level, int) and 0 <= level < len(self.levels)):
            raise _bad_state(f"level {level!r} out of range for {len(self.levels)} levels")
        windows = {}
        for s in self.sources:
            vals = state["windows"][s]
            if not all(isinstance(x, int | float) and 0 <= x <= 1 for x in vals):
                raise _bad_state(f"window of {s!r}: expected accuracies in [0, 1], got {vals!r}")
            windows[s] = deque((float(x) for x in vals), maxlen=self.spec.window)  # a smaller window keeps the last
        self.level, self._windows = level, windows
        self._advance()  # a lowered threshold or window across the resume may pass the level now

    def _metrics(self) -> dict[str, float]:
        out = {"curriculum/level": float(self.level)}
        for s in self.sources:
            acc = self.accuracy(s)
            if acc is not None:
                out[f"curriculum/acc/{s}"] = acc
        return out


_KINDS: dict[str, type[Curriculum]] = {"none": Curriculum, "online": OnlineCurriculum,
                                       "priority": PriorityCurriculum, "level": LevelCurriculum}


def make_curriculum(spec: CurriculumSpec, sources: Sequence[str], seed: int = 0,
                    base_weights: Mapping[str, float] | None = None, prompt_filter: PromptFilterSpec | None = None,
                    stats: Stats | None = None) -> Curriculum:
    """The curriculum `spec.kind` over the blend's `sources`. `stats`: (source, prompt id) -> (samples, passes)
    over earlier runs, for `prompt_filter`; None filters nothing. `base_weights` (the blend's weights at step 0)
    are checked against the sources; the level kind replaces them wholesale (see `weights`)."""
    if not isinstance(spec, CurriculumSpec):
        raise ValueError(f"make_curriculum: spec must be a CurriculumSpec, got {type(spec).__name__}")
    if prompt_filter is not None and not isinstance(prompt_filter, PromptFilterSpec):
        raise ValueError(f"make_curriculum: prompt_filter must be a PromptFilterSpec or None, "
                         f"got {type(prompt_filter).__name__}")
    names = list(sources)
    if not names or not all(isinstance(s, str) and s for s in names):
        raise ValueError(f"make_curriculum: sources must be non-empty names, got {names!r}")
    dup = sorted({s for s in names if names.count(s) > 1})
    if dup:
        raise ValueError(f"make_curriculum: duplicate source name(s) {dup}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"make_curriculum: seed must be an int, got {seed!r}")
    if base_weights is not None:
        unknown = sorted(set(base_weights) - set(names))
        if unknown:
            raise ValueError(f"make_curriculum: base_weights name unknown source(s) {unknown} (sources: {names})")
        bad = {k: w for k, w in base_weights.items()
               if isinstance(w, bool) or not isinstance(w, numbers.Real) or not (math.isfinite(w) and w >= 0)}
        if bad:
            raise ValueError(f"make_curriculum: base_weights must be finite numbers >= 0, got {bad}")
    if spec.kind != "level" and spec.levels:
        raise ValueError(f"curriculum.levels: only used by kind 'level', got kind {spec.kind!r}")
    return _KINDS[spec.kind](spec, names, seed, base_weights, prompt_filter, stats)
