"""The `word_problems` task family: `suites/word_problems.jsonl`, 400 short problems written for the project from
templates (sums, differences, products, fair shares, two-step changes). The answer is extracted from a completion
as the content of the last `\\boxed{...}`, else its last number; it must equal the reference number."""

from __future__ import annotations

import re

from factory.envs.families.suites import Record, SuiteFamily
from factory.problem import Problem
from factory.protocols.task import RewardVerifier

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def word_problem(r: Record) -> Problem:
    return Problem(id=r["id"], prompt=f"{r['question']}\nAnswer: ", answer=r["answer"], op="word", digits=0,
                   meta={"kind": r["kind"]})


def extract_answer(completion: str) -> str | None:
    """The last `\\boxed{...}` content, else the last number in the text; None when there is neither."""
    boxed = _BOXED.findall(completion)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def word_problem_reward(completion: str, problem: Problem) -> float:
    got = extract_answer(completion)
    if got is None:
        return 0.0
    try:
        return 1.0 if float(got) == float(problem.answer) else 0.0
    except ValueError:
        return 0.0


VERIFIER = RewardVerifier(word_problem_reward)
FAMILY = SuiteFamily("word_problems", "word_problems", word_problem, VERIFIER)
