"""A toy task family defined outside factory/: copy a number, the worked example of docs/extending.md ("Adding an
environment"). It uses only the public API (`factory.protocols`, `factory.problem`) and the standard library."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from factory.problem import Problem, Splits

if TYPE_CHECKING:
    from factory.config import DataSpec, TaskSpec

DIGITS = 4  # every problem copies a number of this many digits


@dataclass
class CopyVerifier:
    """1.0 for the number itself; else half the share of the completion's characters that are digits, so even an
    untrained model's completions get graded rewards. Runs in this process: it never executes the completion."""

    detects_hacks: bool = False  # no reward-hack detectors (only verifiers that run code in the sandbox have them)
    scored: list[float] = field(default_factory=list)  # every reward it gave (the test checks the run used them)

    def detail(self, completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
        text = completion.strip()
        reward = 1.0 if text == problem.answer else 0.5 * sum(c.isdigit() for c in text) / max(1, len(text))
        self.scored.append(reward)
        return reward, frozenset()


@dataclass
class CopyFamily:
    """'copy 4729=' -> '4729': the 9 * 10**(DIGITS - 1) numbers of DIGITS digits, drawn without repeats."""

    name: str = "copy"
    verifier: CopyVerifier = field(default_factory=CopyVerifier)

    def capacity(self, task: TaskSpec) -> tuple[int, int]:
        space = 9 * 10 ** (DIGITS - 1)
        return space, space  # every number may be drawn

    def describe(self, task: TaskSpec) -> str:
        return f"task {self.name}"

    def longest_prompts(self, task: TaskSpec, data: DataSpec | None) -> list[str]:
        return [f"copy {'9' * DIGITS}="]  # every prompt has this length

    def splits(self, task: TaskSpec, seed: int) -> Splits:
        numbers = random.Random(f"{self.name}-{seed}").sample(range(10 ** (DIGITS - 1), 10**DIGITS),
                                                             task.n_train + task.n_eval)
        # op: the name the family is registered under, so its problems are scored by its verifier
        problems = [Problem(id=f"copy-{n}", prompt=f"copy {n}=", answer=str(n), op=self.name, digits=DIGITS)
                    for n in numbers]
        return Splits(train=problems[task.n_eval:], eval=problems[: task.n_eval])


FAMILY = CopyFamily()
