"""A task family read from a shipped set, `factory/envs/suites/<file>.jsonl` (one JSON record a line), with the
record -> `Problem` function of its family: every record is a problem, the splits are a seeded shuffle."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from factory.config import DataSpec, TaskSpec
from factory.problem import Problem, Splits
from factory.protocols.task import Verifier

Record = dict[str, Any]


@functools.cache
def records(file: str) -> tuple[Record, ...]:
    """The records of the shipped set `file` (read once per process)."""
    text = resources.files("factory.envs").joinpath("suites", f"{file}.jsonl").read_text()
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


@dataclass(frozen=True)
class SuiteFamily:
    """A `TaskFamily` of every record of `file`, each made a Problem by `make`, scored by `verifier`."""

    name: str
    file: str
    make: Callable[[Record], Problem]
    verifier: Verifier

    def capacity(self, task: TaskSpec) -> tuple[int, int]:
        n = len(records(self.file))
        return n, n

    def describe(self, task: TaskSpec) -> str:
        return f"task {self.name}"

    def longest_prompts(self, task: TaskSpec, data: DataSpec | None) -> list[str]:
        return [self.make(r).prompt for r in records(self.file)]

    def splits(self, task: TaskSpec, seed: int) -> Splits:
        rows = records(self.file)
        if task.n_train + task.n_eval > len(rows):
            raise ValueError(f"task: n_train + n_eval = {task.n_train + task.n_eval} but the {self.name} set has "
                             f"{len(rows)} problems; lower them")
        order = list(rows)
        random.Random(f"{self.name}-{seed}").shuffle(order)
        problems = [self.make(r) for r in order[: task.n_train + task.n_eval]]
        return Splits(train=problems[task.n_eval:], eval=problems[: task.n_eval])
