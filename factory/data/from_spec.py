"""A spec's blend, opened: its sources, their held-out sets, and the blend's version.

Each is handed the part of the spec it reads, not the spec: the blend (`spec.resolved.blend`, config/resolved.py:
the data section, or the task's training split alone, and the seed), or the data section. `open_sources(blend,
train)` opens the sources of its `data` (or, without a `data` section, one source: the task's training split, named
after the task). `held_out_sets(data)` gives each generated source's held-out problems, the `data.held_out` rows
right after its training range (disjoint by construction). `blend_version` is the data version of the blend: a hash
of its sources' versions, the weights or schedule, the seed and the curriculum, so a changed file, weight or
curriculum setting is a new version and equal blends are equal.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from factory.config import Blend, DataSpec, TaskSpec
from factory.data.blender import Blender
from factory.data.sources import make_source
from factory.data.sources.base import ListSource, PromptSource, num_blocks
from factory.data.sources.field import HumanEvalSource
from factory.problem import Problem
from factory.source_spec import SourceError

DEFAULT_BLOCK_ROWS = 1024


def task_source(task: TaskSpec, train: list[Problem]) -> ListSource:
    """The training split `train` of `task` as one source (a run without a `data` section blends only it)."""
    h = hashlib.sha256()
    for p in train:
        h.update(json.dumps(p.to_dict(), sort_keys=True).encode())
    rows = [Problem(p.id, p.prompt, p.answer, p.op, p.digits,
                    {**p.meta, "source": task.name, "verifier": task.environment or task.name})
            for p in train]
    return ListSource(task.name, rows, h.hexdigest()[:16], block_rows=DEFAULT_BLOCK_ROWS)


def open_sources(blend: Blend, train: list[Problem] | None = None, base_dir: str | Path | None = None,
                 catalog=None) -> list[PromptSource]:
    """The blend's sources, in spec order. `train` (the task's training split) is needed only without a `data`
    section; relative file paths are under `base_dir` (default: the working directory)."""
    if blend.data is None:
        if train is None:
            raise ValueError("open_sources: a spec without a data section blends the task's training split: pass it")
        return [task_source(blend.task, train)]
    out = []
    for s in blend.data.sources:
        try:
            out.append(make_source(s, base_dir=base_dir, catalog=catalog))
        except (OSError, ValueError) as e:  # e.g. a file that vanished: say which source (SourceError already does)
            if isinstance(e, SourceError):
                raise
            raise SourceError(f"source {s['name']!r}: {e}") from e
    return out


def blender_for(blend: Blend, sources: list[PromptSource]) -> Blender:
    """`blend` over `sources` (what `open_sources` opened): its schedule and seed."""
    return Blender(sources, schedule=blend.schedule(), seed=blend.seed)


def held_out_sets(data: DataSpec | None) -> dict[str, list[Problem]]:
    """Per generated source, `data.held_out` problems right after its training rows, none of them a training
    row: an arithmetic level's next range of the same seeded order, a reasoning-gym dataset's next entries with
    questions unlike the training rows', HumanEval's next problems (as many as are left; none after the last).
    Empty without a data section."""
    if data is None or data.held_out == 0:
        return {}
    out = {}
    for s in data.sources:
        if s["kind"] in ("reasoning_gym", "humaneval"):
            rows = make_source(s).held_out_rows(data.held_out)
            if rows:
                out[s["name"]] = rows
            continue
        if s["kind"] != "arithmetic":
            continue
        held = {**s, "start": s["start"] + s["n"], "n": data.held_out}
        try:
            src = make_source(held)
        except SourceError as e:
            raise SourceError(f"data.held_out: {e} (the held-out rows follow the source's training rows; lower "
                              f"data.held_out or the source's n)") from None
        out[s["name"]] = [p for b in range(num_blocks(src)) for p in src.read_block(b)]
    return out


def humaneval_benchmark(data: DataSpec | None) -> list[Problem]:
    """The `humaneval` benchmark of a run of blend `data`: HumanEval's problems less those its humaneval sources
    train on."""
    trained: set[str] = set()
    for s in data.sources if data is not None else []:
        if s["kind"] == "humaneval":
            src = make_source(s)
            trained |= {p.id for b in range(num_blocks(src)) for p in src.read_block(b)}
    every = HumanEvalSource("humaneval")
    return [p for b in range(num_blocks(every)) for p in every.read_block(b) if p.id not in trained]


def blend_version(blend: Blend, sources: list[PromptSource]) -> str:
    """The blend's data version: its sources (name, version, length), weights or schedule, seed, curriculum and
    offline filter."""
    d = blend.data
    c = d.curriculum.model_dump(mode="json") if d else {"kind": "none"}
    f = d.filter.model_dump(mode="json") if d and d.filter else None
    parts = {"sources": [[s.name, s.version(), len(s)] for s in sources],
             "schedule": {str(k): v for k, v in sorted(blend.schedule().items())}, "seed": blend.seed,
             "curriculum": c, "filter": f, "format": 1}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
