"""The blender: a deterministic, resumable, exactly-once weighted interleave of prompt sources.

Which source serves the next prompt follows exact quotas (`Quota`): within a segment of constant weights,
every prefix of the stream holds each source's share to within one prompt. Weights may follow a schedule
over training steps ({0: {add2: 0.8, add3: 0.2}, 300: {add2: 0.2, add3: 0.8}}); the consumer says the
step (`set_step`, or `take(step=...)`), and entering a new segment restarts the quota counters. Which row a
source serves next is its seeded epoch order (factory/data/shuffle.py): O(1) per row, one cached block per
source, a new shuffle each epoch.

Exactly-once with groups in flight: `take()` hands out `(draw_id, problem)` where the draw id is the
position in the blend stream, and `done(ids)` marks draws trained (or dropped). `state_dict()` holds the
stream position (per source: epoch and position; the quota counters; the step), the seed, the sources'
versions, and the draws handed out but not done; after `load_state_dict()` those are served again first,
in their original order, before the stream goes on. So a resumed consumer trains exactly the prompts of an
uninterrupted one. Resuming reads nothing and replays nothing: its cost does not depend on the position.

All public methods hold one lock (producer threads call `take()` concurrently); the only thing done under
it that can wait is reading a block of a source.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from factory.data.shuffle import EpochOrder, mix64, name_key
from factory.data.sources.base import PromptSource
from factory.problem import Problem

STATE_FORMAT = 1
Weights = Mapping[str, float]
Schedule = Mapping[int, Weights]


class Quota:
    """Exact quotas for n sources with fixed shares w (sum 1): Tijdeman's chairman-assignment rule.

    At time t (1-based), with s_i prompts served so far, the candidates are the sources with
    w_i*t - s_i >= d, d = 1/(2n-2), and the one chosen is the candidate with the earliest deadline
    (1 - d + s_i) / w_i (ties: the lower index). Tijdeman ("The chairman assignment problem", Discrete
    Math. 32, 1980) proves |s_i(t) - w_i*t| <= 1 - 1/(2n-2) < 1 for every i and every t, i.e. every prefix
    holds each share to within one prompt; tests/data/test_blender.py checks it with hypothesis. The
    simpler largest-deficit rule (nginx's smooth weighted round-robin) does not: its error reaches 1.1
    with 7 sources. Sources with weight 0 are never chosen and do not count in n.
    """

    def __init__(self, weights: Sequence[float], t: int = 0, served: Sequence[int] | None = None):
        self.w = list(weights)
        self.active = [i for i, w in enumerate(self.w) if w > 0]
        self.inv = [1.0 / w if w > 0 else math.inf for w in self.w]
        n = len(self.active)
        # a hair of slack so that rounding in w_i*t never empties the candidate set (n = 2 sits on the edge)
        self.d = 1.0 / (2 * n - 2) - 1e-9 if n > 1 else 0.0
        self.t = t
        self.served = list(served) if served is not None else [0] * len(self.w)

    def pick(self) -> int:
        t = self.t + 1
        w, s, inv, d = self.w, self.served, self.inv, self.d
        best, best_key = -1, math.inf
        for i in self.active:
            si = s[i]
            if w[i] * t - si >= d:
                key = (1.0 - d + si) * inv[i]
                if key < best_key:
                    best, best_key = i, key
        if best < 0:  # unreachable by the theorem; fall back to the largest deficit rather than stall
            best = max(self.active, key=lambda i: w[i] * t - s[i])
        s[best] += 1
        self.t = t
        return best

    def errors(self) -> list[float]:
        """s_i - w_i*t per source: over (+) or under (-) its exact share so far in this segment."""
        return [s - w * self.t for s, w in zip(self.served, self.w, strict=True)]


class _Cursor:
    """One source's place in its seeded stream: epoch, position in the epoch, and the one cached block."""

    __slots__ = ("source", "n", "key", "epoch", "pos", "order", "start", "end", "rows", "perm", "_replayed")

    def __init__(self, source: PromptSource, seed: int):
        self.source, self.n = source, len(source)
        self.key = mix64(seed, name_key(source.name))
        self.epoch, self.pos = 0, 0
        self.order: EpochOrder | None = None
        self.start = self.end = 0  # epoch positions [start, end) covered by the cached block
        self.rows: list[Problem] = []
        self.perm: list[int] = []
        self._replayed: tuple[int, int, list[Problem], list[int]] | None = None  # (epoch, block, rows, perm)

    def seek(self, epoch: int, pos: int) -> None:
        self.epoch, self.pos = epoch, pos
        self.order, self.start, self.end = None, 0, 0

    def epoch_order(self, epoch: int) -> EpochOrder:
        return EpochOrder(self.n, self.source.block_rows, mix64(self.key, epoch))

    def read(self, order: EpochOrder, block: int) -> tuple[list[Problem], list[int]]:
        rows = self.source.read_block(block)
        if len(rows) != order.block_len(block):
            raise ValueError(f"source {self.source.name!r}: block {block} has {len(rows)} rows, expected "
                             f"{order.block_len(block)} (len {self.n}, block_rows {self.source.block_rows})")
        return rows, order.row_perm(block)

    def next(self) -> tuple[int, int, Problem]:
        """The next row: (epoch, position, problem); moves on, into a new epoch after the last row."""
        epoch, pos = self.epoch, self.pos
        if not self.start <= pos < self.end or self.order is None:
            if self.order is None:
                self.order = self.epoch_order(epoch)
            block, off, start = self.order.locate(pos)
            self.rows, self.perm = self.read(self.order, block)
            self.start, self.end = start, start + len(self.rows)
        problem = self.rows[self.perm[pos - self.start]]
        self.pos = pos + 1
        if self.pos == self.n:
            self.epoch, self.pos, self.order, self.start, self.end = epoch + 1, 0, None, 0, 0
        return epoch, pos, problem

    def at(self, epoch: int, pos: int) -> Problem:
        """The row at (epoch, pos), without moving (a draw served again after a resume)."""
        order = self.epoch_order(epoch)
        block, off, _ = order.locate(pos)
        cached = self._replayed
        if cached is None or cached[:2] != (epoch, block):  # draws in flight mostly share a few blocks
            cached = self._replayed = (epoch, block, *self.read(order, block))
        return cached[2][cached[3][off]]


def _normalize(schedule: Schedule, names: Sequence[str]) -> dict[int, list[float]]:
    if not schedule:
        raise ValueError("blend schedule: empty (expected {step: {source: weight}})")
    out: dict[int, list[float]] = {}
    for step, weights in sorted(schedule.items()):
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"blend schedule: step {step!r} must be an int >= 0")
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ValueError(f"blend schedule step {step}: unknown source(s) {unknown} (sources: {list(names)})")
        row = []
        for name in names:
            w = weights.get(name, 0.0)
            if not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
                raise ValueError(f"blend schedule step {step}: weight of {name!r} must be a finite number >= 0, "
                                 f"got {w!r}")
            row.append(float(w))
        total = sum(row)
        if total <= 0:
            raise ValueError(f"blend schedule step {step}: all weights are 0")
        out[step] = [w / total for w in row]
    if 0 not in out:
        raise ValueError(f"blend schedule: the first segment must start at step 0, got {min(out)}")
    return out


class Blender:
    """A weighted interleave of `sources` by `weights` (fixed) or `schedule` (step -> weights)."""

    def __init__(self, sources: Sequence[PromptSource], weights: Weights | None = None,
                 schedule: Schedule | None = None, seed: int = 0):
        if (weights is None) == (schedule is None):
            raise ValueError("blender: give exactly one of weights= (fixed) or schedule= (step -> weights)")
        names = [s.name for s in sources]
        if not names:
            raise ValueError("blender: no sources")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"blender: duplicate source name(s) {dup}")
        for s in sources:
            if len(s) < 1:
                raise ValueError(f"source {s.name!r} is empty")
            if s.block_rows < 1:
                raise ValueError(f"source {s.name!r}: block_rows must be >= 1, got {s.block_rows}")
        self.names = names
        self.sources = list(sources)
        self.index = {n: i for i, n in enumerate(names)}
        self.schedule = _normalize(schedule if schedule is not None else {0: weights}, names)
        self._starts = sorted(self.schedule)
        self.seed = seed
        self.versions = [s.version() for s in sources]
        self._cursors = [_Cursor(s, seed) for s in sources]
        self._lock = threading.Lock()
        self.step = 0
        self.segment = 0
        self._quota = Quota(self.schedule[0])
        self._override: list[float] | None = None  # weights set at run time (level curriculum) until a new segment
        # [segment start step, draws served in it, its weights if set at run time], for the report
        self._history: list[list[Any]] = [[0, 0, None]]
        self._next_draw = 0
        self._in_flight: dict[int, tuple[int, int, int]] = {}  # draw id -> (source, epoch, position)
        self._replay: deque[tuple[int, int, int, int]] = deque()
        self._taken = [0] * len(names)
        self._done = [0] * len(names)

    # -- the stream ----------------------------------------------------------------------------------------

    def _segment_of(self, step: int) -> int:
        seg = 0
        for start in self._starts:
            if start <= step:
                seg = start
        return seg

    def _set_step(self, step: int) -> None:
        if step < 0:
            raise ValueError(f"blender: step must be >= 0, got {step}")
        self.step = step
        seg = self._segment_of(step)
        if seg != self.segment:  # exact quotas hold per segment: the counters start over with the new weights
            self.segment = seg
            self._override = None
            self._quota = Quota(self.schedule[seg])
            self._history.append([seg, 0, None])

    def set_step(self, step: int) -> None:
        """The training step the next prompts are for (selects the schedule's weights)."""
        with self._lock:
            self._set_step(step)

    def _take(self) -> tuple[int, Problem]:
        if self._replay:
            draw, src, epoch, pos = self._replay.popleft()
            self._in_flight[draw] = (src, epoch, pos)
            return draw, self._cursors[src].at(epoch, pos)
        src = self._quota.pick()
        epoch, pos, problem = self._cursors[src].next()
        draw = self._next_draw
        self._next_draw = draw + 1
        self._in_flight[draw] = (src, epoch, pos)
        self._taken[src] += 1
        self._history[-1][1] += 1
        return draw, problem

    def set_weights(self, weights: Weights) -> None:
        """New weights from now on (e.g. a level curriculum's), until the schedule's next segment begins: a new
        segment of exact quotas starts here. Sources left out get weight 0."""
        row = _normalize({0: weights}, self.names)[0]
        with self._lock:
            if row == self._quota.w:
                return
            self._override = row
            self._quota = Quota(row)
            self._history.append([self.step, 0, row])

    def weights(self) -> dict[str, float]:
        """The weights in force now (normalized)."""
        with self._lock:
            return dict(zip(self.names, self._quota.w, strict=True))

    def problem_of(self, draw: int) -> Problem:
        """The problem of a draw in flight (taken, not yet done)."""
        with self._lock:
            if draw not in self._in_flight:
                raise ValueError(f"blender.problem_of: draw {draw} is not in flight")
            src, epoch, pos = self._in_flight[draw]
            return self._cursors[src].at(epoch, pos)

    def take(self, step: int | None = None) -> tuple[int, Problem]:
        """The next prompt and its draw id (draws in flight before a resume come first, in order)."""
        with self._lock:
            if step is not None:
                self._set_step(step)
            return self._take()

    def take_many(self, k: int, step: int | None = None) -> list[tuple[int, Problem]]:
        """k prompts at once under one lock acquisition (same stream as k calls of `take`)."""
        with self._lock:
            if step is not None:
                self._set_step(step)
            return [self._take() for _ in range(k)]

    def done(self, draw_ids: Iterable[int]) -> None:
        """Mark draws trained or dropped: they will not be served again after a resume."""
        ids = list(draw_ids)
        with self._lock:
            missing = [d for d in ids if d not in self._in_flight]
            if missing or len(set(ids)) != len(ids):
                raise ValueError(f"blender.done: draw(s) {missing or sorted(ids)} not in flight "
                                 f"(never taken, already done, or listed twice)")
            for d in ids:
                self._done[self._in_flight.pop(d)[0]] += 1

    @property
    def total_rows(self) -> int:
        """Rows over all sources (one epoch of each)."""
        return sum(c.n for c in self._cursors)

    def in_flight(self) -> list[int]:
        with self._lock:
            return sorted(self._in_flight)

    # -- resume --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The resume point (JSON-serializable); draws in flight are recorded to be served again."""
        with self._lock:
            pending = sorted([d, *v] for d, v in self._in_flight.items())
            pending += [list(r) for r in self._replay]  # taken before a resume, not yet served again
            return {
                "format": STATE_FORMAT,
                "seed": self.seed,
                "step": self.step,
                "segment": self.segment,
                "segment_weights": self._quota.w,
                "override": self._override,
                "quota_t": self._quota.t,
                "quota_served": {n: self._quota.served[i] for i, n in enumerate(self.names)},
                "next_draw": self._next_draw,
                "history": [list(h) for h in self._history],
                "sources": {n: {"version": self.versions[i], "epoch": c.epoch, "pos": c.pos,
                                "taken": self._taken[i], "done": self._done[i]}
                            for i, (n, c) in enumerate(zip(self.names, self._cursors, strict=True))},
                "in_flight": [[d, self.names[s], e, p] for d, s, e, p in sorted(pending)],
            }

    def load_state_dict(self, state: Mapping[str, Any], keep: Iterable[int] = ()) -> None:
        """Continue from `state`: same sources (name and version) and seed; O(1) in the stream position.

        Draws in flight at the resume point are served again, except those in `keep`: they stay in flight (their
        groups were restored elsewhere, e.g. into a rollout buffer) until `done`."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"blender state: format {state.get('format')!r}, expected {STATE_FORMAT}")
        if state["seed"] != self.seed:
            raise ValueError(f"blender state: seed {state['seed']} differs from this blender's {self.seed}")
        saved = state["sources"]
        if set(saved) != set(self.names):
            raise ValueError(f"blender state: sources {sorted(saved)} differ from this blender's {sorted(self.names)}")
        for i, n in enumerate(self.names):
            if saved[n]["version"] != self.versions[i]:
                raise ValueError(f"blender state: source {n!r} was at version {saved[n]['version']!r}, "
                                 f"now {self.versions[i]!r} (its rows changed; the position would be wrong)")
            if not 0 <= saved[n]["pos"] < self._cursors[i].n or saved[n]["epoch"] < 0:
                raise ValueError(f"blender state: source {n!r} epoch {saved[n]['epoch']} position "
                                 f"{saved[n]['pos']} out of range (len {self._cursors[i].n})")
        unknown = sorted({n for _, n, _, _ in state["in_flight"]} - set(self.names))
        if unknown:
            raise ValueError(f"blender state: draws in flight from unknown source(s) {unknown}")
        with self._lock:
            for i, n in enumerate(self.names):
                s = saved[n]
                self._cursors[i].seek(s["epoch"], s["pos"])
                self._taken[i], self._done[i] = s["taken"], s["done"]
            self.step, self.segment = state["step"], state["segment"]
            self._history = [[*h, None][:3] for h in state["history"]]
            served = [state["quota_served"][n] for n in self.names]
            self._override = state.get("override")
            weights = self._override or self.schedule.get(self.segment, state["segment_weights"])
            self._quota = Quota(weights, state["quota_t"], served)
            if self._quota.w != list(state["segment_weights"]) or self._segment_of(self.step) != self.segment:
                # the schedule changed across the resume: exact quotas start over from here with the new weights
                self.segment = self._segment_of(self.step)
                self._override = None
                self._quota = Quota(self.schedule[self.segment])
                self._history.append([self.segment, 0, None])
            self._next_draw = state["next_draw"]
            kept = set(keep)
            self._in_flight = {d: (self.index[n], e, p) for d, n, e, p in state["in_flight"] if d in kept}
            self._replay = deque((d, self.index[n], e, p) for d, n, e, p in state["in_flight"] if d not in kept)

    # -- metrics -------------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Per source: target share (now and over the stream so far) vs realized share, and its counters."""
        with self._lock:
            total = sum(self._taken)
            stream_target = [0.0] * len(self.names)
            for seg, n, set_weights in self._history:
                for i, w in enumerate(set_weights or self.schedule.get(seg, self._quota.w)):
                    stream_target[i] += w * n
            errors = self._quota.errors()
            in_flight = [0] * len(self.names)
            for s, _, _ in self._in_flight.values():
                in_flight[s] += 1
            for _, s, _, _ in self._replay:
                in_flight[s] += 1
            return {
                "draws": total, "step": self.step, "segment": self.segment,
                "sources": {n: {
                    "target_share": self._quota.w[i],
                    "stream_target_share": stream_target[i] / total if total else self._quota.w[i],
                    "realized_share": self._taken[i] / total if total else None,  # nothing drawn yet
                    "quota_error": errors[i],
                    "taken": self._taken[i], "done": self._done[i], "in_flight": in_flight[i],
                    "epoch": self._cursors[i].epoch, "position": self._cursors[i].pos,
                } for i, n in enumerate(self.names)},
            }
