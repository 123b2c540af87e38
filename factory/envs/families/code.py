"""The `code` task family: `suites/code_problems.jsonl`, small Python functions (a signature and docstring as the
prompt, a reference body, three unit tests each). The completion is the body; the reward is the fraction of unit
tests that pass, as the trusted harness of `envs/code_harness.py` reports it from the sandbox pool
(`envs/pool.py`), never in this process and never from the completion's own output."""

from __future__ import annotations

import re
from typing import Any

from factory.envs.code_harness import run_checks
from factory.envs.families.suites import Record, SuiteFamily
from factory.envs.pool import sandbox_pool
from factory.problem import Problem

_ENTRY = re.compile(r"^def ([A-Za-z_]\w*)\(", re.MULTILINE)


def code_problem(r: Record) -> Problem:
    return Problem(id=r["id"], prompt=r["prompt"], answer=r["solution"], op="code", digits=0,
                   meta={"tests": list(r["tests"])})


def code_checks(problem: Problem) -> tuple[dict[str, Any], str]:
    """The harness's checks for a built-in `code` problem (its unit-test expressions) and the function they call
    (the one the prompt defines). ValueError naming the problem when it has no tests or defines no function."""
    tests_ = problem.meta.get("tests")
    if not isinstance(tests_, list) or not tests_ or not all(isinstance(t, str) for t in tests_):
        raise ValueError(f"code problem {problem.id}: meta.tests must be a non-empty list of expressions, "
                         f"got {tests_!r}")
    m = _ENTRY.search(problem.prompt)
    if m is None:
        raise ValueError(f"code problem {problem.id}: its prompt defines no function (expected 'def name(')")
    return {"kind": "code", "tests": tests_}, m.group(1)


def code_detail(completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
    """(fraction of the problem's unit tests that pass, the hack detectors the completion tripped), run by the
    trusted harness of `envs/code_harness.py` in the sandbox pool: the verdict is the harness's, never the code's.
    The pool returns a result for anything the code does; a pool that cannot isolate raises."""
    checks, entry = code_checks(problem)
    return run_checks(sandbox_pool(), problem.prompt + completion, checks, entry, len(checks["tests"]),
                      completion)


class CodeVerifier:
    detects_hacks = True

    def detail(self, completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
        return code_detail(completion, problem)


VERIFIER = CodeVerifier()
FAMILY = SuiteFamily("code", "code_problems", code_problem, VERIFIER)
