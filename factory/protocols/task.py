"""The task-family and verifier extension points: a `TaskFamily` (a family of problems: how many it has, its
longest prompts, its disjoint train / held-out splits, its verifier), a `Verifier` (one completion of a problem
-> a reward in [0, 1] and the reward-hack detectors it tripped), and their registries: `TASK_FAMILIES`, keyed by
`task.name`, and `VERIFIERS`, keyed by a problem's `op`.

Why verifiers have a registry of their own rather than living only inside a family: more things are scored than
there are families. Rows of data sources name a verifier (reasoning_gym, math_verify, humaneval) that belongs to
no task family, and a family's verifier also scores rows of other sources that name it. A problem is scored by
`VERIFIERS[problem.op]` if registered, else by the verifier of the task family named `problem.op` (so a new family
whose problems carry its own name as `op` needs only its one `TASK_FAMILIES` registration), else by the exact
arithmetic check (factory/envs/tasks.py `verifier_for`).

Security: a verifier of generated code must run it in the sandbox pool (factory/envs/tasks.py `sandbox_pool`)
through the trusted harness (factory/envs/code_harness.py) and take its verdict from the harness, never from
anything the program prints or writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from factory.problem import Problem, Splits
from factory.protocols.registry import Registry

if TYPE_CHECKING:
    from factory.config import DataSpec, TaskSpec


@runtime_checkable
class Verifier(Protocol):
    """Scores one completion of a problem."""

    detects_hacks: bool  # it runs the reward-hack detectors (the code verifiers): its problems get a hack count

    def detail(self, completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
        """(the reward, in [0, 1], the reward-hack detectors the completion tripped). Returns for anything the
        completion does; raises only for what is not the completion's fault (no sandbox that can isolate, a
        malformed problem), which stops the caller."""
        ...


@runtime_checkable
class TaskFamily(Protocol):
    """A family of problems, selected by `task.name`. Its prompts are read by the project's character tokenizer
    (one token per character plus `<bos>`) unless the spec's model brings its own."""

    name: str
    verifier: Verifier  # scores its problems (and rows of sources whose verifier names this family)

    def capacity(self, task: TaskSpec) -> tuple[int, int]:
        """(distinct problems under `task`'s settings, the most that n_train + n_eval may take)."""
        ...

    def describe(self, task: TaskSpec) -> str:
        """The family as an error message names it, e.g. 'task code' or 'task arithmetic with digits [3]'."""
        ...

    def longest_prompts(self, task: TaskSpec, data: DataSpec | None) -> list[str]:
        """Prompts at least as long as any the family will pose (and, where it generates them, the data
        section's sources of its kind), for a tokenizer to measure and the spec check to fit into positions."""
        ...

    def splits(self, task: TaskSpec, seed: int) -> Splits:
        """Disjoint train / held-out problems, `task.n_train` and `task.n_eval` of them, the same for the same
        seed; a ValueError naming the field when the family has too few."""
        ...


@dataclass(frozen=True)
class RewardVerifier:
    """A `Verifier` from a plain `reward(completion, problem) -> float` that runs in this process: whatever it
    raises or returns that is not a finite number scores 0 (a reward never takes the run down), and it has no
    reward-hack detectors. For generated code use the sandbox pool instead (see the module docstring)."""

    reward: Callable[[str, Problem], float]
    detects_hacks: bool = False

    def detail(self, completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
        try:
            value = float(self.reward(completion, problem))
        except Exception:  # noqa: BLE001 - a reward must never take the run down
            return 0.0, frozenset()
        return (value if math.isfinite(value) else 0.0), frozenset()


def _family(name: str, obj: object) -> TaskFamily:
    if not isinstance(obj, TaskFamily):
        raise ValueError(f"task.name {name!r}: {type(obj).__name__} is not a TaskFamily (it needs name, verifier, "
                         "capacity, describe, longest_prompts and splits)")
    return obj


def _verifier(name: str, obj: object) -> Verifier:
    if not isinstance(obj, Verifier):
        raise ValueError(f"verifier {name!r}: {type(obj).__name__} is not a Verifier (it needs detects_hacks and "
                         "detail(completion, problem)); wrap a reward function in RewardVerifier")
    return obj


_FAMILIES = "factory.envs.families"
TASK_FAMILIES: Registry[TaskFamily] = Registry(
    "task family", "task.name",
    {"arithmetic": f"{_FAMILIES}.arithmetic:FAMILY", "word_problems": f"{_FAMILIES}.word_problems:FAMILY",
     "code": f"{_FAMILIES}.code:FAMILY"},
    group="factory.task_families", check=_family)

# Keyed by Problem.op: the arithmetic operations, the shipped sets' ops ("word", "code") and the field's verifiers
# (rows of those sources carry the verifier's name as op).
_ARITHMETIC = f"{_FAMILIES}.arithmetic:VERIFIER"
VERIFIERS: Registry[Verifier] = Registry(
    "verifier", "problem.op",
    {"arithmetic": _ARITHMETIC, "add": _ARITHMETIC, "sub": _ARITHMETIC, "mul": _ARITHMETIC,
     "word": f"{_FAMILIES}.word_problems:VERIFIER", "code": f"{_FAMILIES}.code:VERIFIER",
     "reasoning_gym": f"{_FAMILIES}.field:REASONING_GYM", "math_verify": f"{_FAMILIES}.field:MATH_VERIFY",
     "humaneval": f"{_FAMILIES}.field:HUMANEVAL"},
    group="factory.verifiers", check=_verifier)
