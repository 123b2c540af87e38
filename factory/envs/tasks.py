"""Task families and their verifiers: generated arithmetic, and shipped word problems and code problems.

- `arithmetic` (`envs/arithmetic.py`): generated from the seed.
- `word_problems`: `suites/word_problems.jsonl`, 400 short problems written for the project from templates
  (sums, differences, products, fair shares, two-step changes). The answer is extracted from a completion
  as the content of the last `\\boxed{...}`, else its last number; it must equal the reference number.
- `reasoning_gym`, `math_verify`, `humaneval` (rows of the data sources of those kinds, or any source naming
  the verifier): `envs/reasoning_gym_tasks.py`, `envs/math_answers.py`, `envs/humaneval.py`.
- `code`: `suites/code_problems.jsonl`, small Python functions (a signature and docstring as the prompt, a
  reference body, three unit tests each). The completion is the body; the reward is the fraction of unit
  tests that pass, as the trusted harness of `envs/code_harness.py` reports it from the sandbox pool
  (`envs/sandbox.py`), never in this process and never from the completion's own output.

`make_task_splits(task, seed)` gives disjoint train / held-out splits of any family; `verify(completion,
problem)` scores one completion in [0, 1] and never raises; `verify_detail` adds the hack detectors it tripped.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import random
import re
import threading
from importlib import resources
from typing import Any

from factory.config import TaskSpec
from factory.envs.arithmetic import OPS, arithmetic_capacity, make_splits, prompt_tokens
from factory.envs.arithmetic import reward as arithmetic_reward
from factory.envs.code_harness import run_checks
from factory.envs.humaneval import humaneval_detail
from factory.envs.sandbox import SandboxPool
from factory.problem import Problem, Splits

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@functools.cache
def _records(name: str) -> tuple[dict[str, Any], ...]:
    text = resources.files("factory.envs").joinpath("suites", f"{name}.jsonl").read_text()
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def _word_problem(r: dict[str, Any]) -> Problem:
    return Problem(id=r["id"], prompt=f"{r['question']}\nAnswer: ", answer=r["answer"], op="word", digits=0,
                   meta={"kind": r["kind"]})


def _code_problem(r: dict[str, Any]) -> Problem:
    return Problem(id=r["id"], prompt=r["prompt"], answer=r["solution"], op="code", digits=0,
                   meta={"tests": list(r["tests"])})


# task.name -> (its shipped set under suites/, record -> Problem)
_SETS = {"word_problems": ("word_problems", _word_problem), "code": ("code_problems", _code_problem)}


def task_capacity(task: TaskSpec) -> tuple[int, int]:
    """(distinct problems of the task family, the most that n_train + n_eval may take): half of the generated
    arithmetic problems (see `make_splits`), every problem of a shipped set."""
    if task.name == "arithmetic":
        space = arithmetic_capacity(task.operations, task.digits)
        return space, space // 2
    n = len(_records(_SETS[task.name][0]))
    return n, n


def longest_prompt_tokens(task: TaskSpec) -> int:
    """Tokens of the task's longest prompt under its character tokenizer (`models/tokenizer.py`: one token per
    character, plus `<bos>`): the first turn of a multi-turn episode too."""
    if task.name == "arithmetic":
        return prompt_tokens(task.digits)
    name, make = _SETS[task.name]
    return 1 + max(len(make(r).prompt) for r in _records(name))


def longest_prompts(task: TaskSpec, data: Any = None) -> list[str]:
    """Prompts at least as long as any the task (and the data section's generated sources) will pose, for a
    tokenizer to measure: every shipped prompt, or arithmetic prompts with operands of the most digits (each op).
    File sources are checked as they are read."""
    if task.name != "arithmetic":
        name, make = _SETS[task.name]
        return [make(r).prompt for r in _records(name)]
    digits = [max(task.digits)]
    if data is not None:
        digits += [s["digits"] for s in data.sources if s["kind"] == "arithmetic"]
    out = []
    for d in sorted(set(digits)):
        for sym in OPS.values():
            out += [f"{'9' * d}{sym}{'9' * d}=", f"1{'0' * (d - 1)}{sym}1{'0' * (d - 1)}="]
    return out


def make_task_splits(task: TaskSpec, seed: int) -> Splits:
    """Disjoint train / held-out splits of the task family (a seeded shuffle of a shipped set)."""
    if task.name == "arithmetic":
        return make_splits(task, seed)
    name, make = _SETS[task.name]
    records = _records(name)
    if task.n_train + task.n_eval > len(records):
        raise ValueError(f"task: n_train + n_eval = {task.n_train + task.n_eval} but the {task.name} set has "
                         f"{len(records)} problems; lower them")
    order = list(records)
    random.Random(f"{task.name}-{seed}").shuffle(order)
    problems = [make(r) for r in order[: task.n_train + task.n_eval]]
    return Splits(train=problems[task.n_eval:], eval=problems[: task.n_eval])


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


_ENTRY = re.compile(r"^def ([A-Za-z_]\w*)\(", re.MULTILINE)


def code_checks(problem: Problem) -> tuple[dict[str, Any], str]:
    """The harness's checks for a built-in `code` problem (its unit-test expressions) and the function they call
    (the one the prompt defines). ValueError naming the problem when it has no tests or defines no function."""
    tests = problem.meta.get("tests")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(f"code problem {problem.id}: meta.tests must be a non-empty list of expressions, "
                         f"got {tests!r}")
    m = _ENTRY.search(problem.prompt)
    if m is None:
        raise ValueError(f"code problem {problem.id}: its prompt defines no function (expected 'def name(')")
    return {"kind": "code", "tests": tests}, m.group(1)


_POOL_LOCK = threading.Lock()
_POOL = None
_CONFIG: dict[str, Any] = {}


def configure_sandbox(size: int, isolation: str, cpus: list[int] | None = None) -> None:
    """The pool this process's rewards and tools use (a spec's `task.sandbox_workers` / `sandbox_isolation`);
    a running pool with other settings is closed and replaced on next use."""
    global _POOL
    with _POOL_LOCK:
        new = {"size": int(size), "isolation": isolation, "cpus": sorted(cpus) if cpus else None}
        if new != _CONFIG and _POOL is not None:
            _POOL.close()
            _POOL = None
        _CONFIG.clear()
        _CONFIG.update(new)


def _env_cpus(name: str) -> list[int] | None:
    value = os.environ.get(name, "").strip()
    try:
        return [int(c) for c in value.split(",")] if value else None
    except ValueError:
        raise ValueError(f"${name}: expected comma-separated CPU numbers, got {value!r}") from None


def sandbox_pool():
    """The sandbox pool that code rewards and tools run in: the pool service at $FACTORY_SANDBOX_URL (`factory
    sandbox-serve`, e.g. on another machine) if set, else this process's own, started on first use with the
    settings of `configure_sandbox` (from the spec), else $FACTORY_SANDBOX_SIZE (default 4) and
    $FACTORY_SANDBOX_ISOLATION (default bwrap; `none` only when explicitly set), on the cores of
    `task.sandbox_cpus` or $FACTORY_SANDBOX_CPUS ("0,1"; default: the caller's)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            if url := os.environ.get("FACTORY_SANDBOX_URL"):
                from factory.envs.sandbox_service import RemoteSandboxPool  # heavy: fastapi, uvicorn (its server side)

                _POOL = RemoteSandboxPool(url)
            else:
                _POOL = SandboxPool(
                    size=_CONFIG.get("size") or int(os.environ.get("FACTORY_SANDBOX_SIZE", "4")),
                    isolation=_CONFIG.get("isolation") or os.environ.get("FACTORY_SANDBOX_ISOLATION", "bwrap"),
                    cpus=_CONFIG.get("cpus") or _env_cpus("FACTORY_SANDBOX_CPUS"),
                ).start()
        return _POOL


def code_detail(completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
    """(fraction of the problem's unit tests that pass, the hack detectors the completion tripped), run by the
    trusted harness of `envs/code_harness.py` in the sandbox pool: the verdict is the harness's, never the code's."""
    checks, entry = code_checks(problem)
    return run_checks(sandbox_pool(), problem.prompt + completion, checks, entry, len(checks["tests"]), completion)


def code_reward(completion: str, problem: Problem) -> float:
    """Fraction of the problem's unit tests that pass, run in the sandbox pool (see `code_detail`)."""
    return code_detail(completion, problem)[0]


# The field's verifiers (rows whose op names them), scored in this process: module and function, imported on
# first use (they load reasoning-gym or math-verify only when such a row is scored). HumanEval runs in the pool.
FIELD_VERIFIERS = {"reasoning_gym": ("factory.envs.reasoning_gym_tasks", "rg_reward"),
                   "math_verify": ("factory.envs.math_answers", "math_verify_reward")}


def _bounded(reward: float) -> float:
    """A shipped verifier's reward in its documented range [0, 1]: anything else (a bug) is clamped, NaN is 0."""
    return min(1.0, max(0.0, reward)) if math.isfinite(reward) else 0.0


# The names that score with the task families' verifiers (`verify_detail`), whichever family a problem is of.
TASK_VERIFIERS = ("arithmetic", "word_problems", "code", "reasoning_gym", "math_verify", "humaneval")
HACK_DETECTING_OPS = frozenset({"code", "humaneval"})  # the verifiers that run reward-hack detectors


def runs_hack_detectors(problem: Problem, scorer: str | None = None) -> bool:
    """Whether scoring `problem` with `scorer` (None: the task's verifier) runs the reward-hack detectors: only the
    code verifiers have them, so a step of other problems has no hack count at all (not a count of 0)."""
    return problem.op in HACK_DETECTING_OPS and (scorer is None or scorer in TASK_VERIFIERS)


def verify_detail(completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
    """`verify`'s reward and the hack detectors (`code_harness.HACK_FLAGS`) the completion tripped: a signal for
    the step's metrics, never part of the reward; only code verifiers have detectors (empty for the others)."""
    if problem.op == "code":
        reward, flags = code_detail(completion, problem)  # the pool returns a result for anything the code does
    elif problem.op == "humaneval":
        reward, flags = humaneval_detail(completion, problem, sandbox_pool())  # the harness's verdict
    else:
        reward, flags = _scored_here(completion, problem), frozenset()
    return _bounded(reward), flags


def _scored_here(completion: str, problem: Problem) -> float:
    try:
        if problem.op in FIELD_VERIFIERS:
            module, fn = FIELD_VERIFIERS[problem.op]
            return float(getattr(importlib.import_module(module), fn)(completion, problem))
        if problem.op == "word":
            return word_problem_reward(completion, problem)
        return arithmetic_reward(completion, problem)
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0


def verify(completion: str, problem: Problem) -> float:
    """The task family's reward for one completion of `problem`, in [0, 1]; 0 for whatever the completion does.
    A sandbox pool that cannot isolate (`IsolationUnavailable`) or a malformed code problem (ValueError naming
    it) is not a completion's fault: those raise."""
    return verify_detail(completion, problem)[0]
