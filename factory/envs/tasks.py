"""Task families and verifiers by name (and, re-exported, the sandbox pool code verifiers and tools run in:
`envs/pool.py`).

The families (`task.name`) and verifiers (a problem's `op`) are registries of factory/protocols/task.py; the
built-ins are one module each under factory/envs/families/:
- `arithmetic`: generated from the seed (`envs/arithmetic.py`).
- `word_problems`: `suites/word_problems.jsonl`, short problems; the answer is the last `\\boxed{...}`, else the
  last number, of a completion.
- `code`: `suites/code_problems.jsonl`, small Python functions; the reward is the fraction of unit tests that pass
  as the trusted harness of `envs/code_harness.py` reports it from the sandbox pool (`envs/sandbox.py`), never in
  this process and never from the completion's own output.
- `reasoning_gym`, `math_verify`, `humaneval`: the field's verifiers of source rows (`families/field.py`).

`make_task_splits(task, seed)` gives disjoint train / held-out splits of any family; `verify(completion,
problem)` scores one completion in [0, 1] and never raises for what the completion does; `verify_detail` adds
the hack detectors it tripped.
"""

from __future__ import annotations

import math

from factory.config import DataSpec, TaskSpec
from factory.envs.families.code import code_checks, code_detail, code_problem
from factory.envs.families.suites import records as _records  # noqa: F401 - data/sources/generated.py reads it here
from factory.envs.families.word_problems import extract_answer, word_problem, word_problem_reward
from factory.envs.pool import configure_sandbox, sandbox_pool
from factory.problem import Problem, Splits
from factory.protocols.task import TASK_FAMILIES, VERIFIERS, TaskFamily, Verifier

__all__ = ["TASK_VERIFIERS", "code_checks", "code_detail", "code_reward", "configure_sandbox", "extract_answer",
           "family", "family_named", "is_task_verifier", "longest_prompt_tokens", "longest_prompts", "make_task_splits",
           "runs_hack_detectors", "sandbox_pool", "task_capacity", "verifier_for", "verify", "verify_detail",
           "word_problem_reward"]

# task.name -> (its shipped set under suites/, record -> Problem): the sets a `suite` data source may read.
_SETS = {"word_problems": ("word_problems", word_problem), "code": ("code_problems", code_problem)}


def family_named(name: str) -> TaskFamily:
    """The task family `name` names (`TASK_FAMILIES`). One named by import path is registered under its own
    `name` too, on first use in each process: its problems carry that name as their op (`verifier_for`)."""
    found = TASK_FAMILIES.get(name)
    if ":" in name and found.name not in TASK_FAMILIES:
        try:
            TASK_FAMILIES.register(found.name, found)
        except ValueError:  # another thread registered it meanwhile, or its name is no registry name
            pass
    return found


def family(task: TaskSpec) -> TaskFamily:
    """The task family of `task` (the spec validated its name)."""
    return family_named(task.name)


def task_capacity(task: TaskSpec) -> tuple[int, int]:
    """(distinct problems of the task family, the most that n_train + n_eval may take): half of the generated
    arithmetic problems (see `arithmetic.make_splits`), every problem of a shipped set."""
    return family(task).capacity(task)


def longest_prompts(task: TaskSpec, data: DataSpec | None = None) -> list[str]:
    """Prompts at least as long as any the task (and the data section's generated sources) will pose, for a
    tokenizer to measure. File sources are checked as they are read."""
    return family(task).longest_prompts(task, data)


def longest_prompt_tokens(task: TaskSpec) -> int:
    """Tokens of the task's longest prompt under its character tokenizer (`models/tokenizer.py`: one token per
    character, plus `<bos>`): the first turn of a multi-turn episode too."""
    return 1 + max(len(p) for p in family(task).longest_prompts(task, None))


def make_task_splits(task: TaskSpec, seed: int) -> Splits:
    """Disjoint train / held-out splits of the task family (e.g. a seeded shuffle of a shipped set)."""
    return family(task).splits(task, seed)


def code_reward(completion: str, problem: Problem) -> float:
    """Fraction of the problem's unit tests that pass, run in the sandbox pool (see `code_detail`)."""
    return code_detail(completion, problem)[0]


def _bounded(reward: float) -> float:
    """A verifier's reward in its documented range [0, 1]: anything else (a bug) is clamped, NaN is 0."""
    return min(1.0, max(0.0, reward)) if math.isfinite(reward) else 0.0


# The built-in names that score with the verifiers (`verify_detail`), whichever family a problem is of; a
# registered task family or verifier does too (`is_task_verifier`).
TASK_VERIFIERS = ("arithmetic", "word_problems", "code", "reasoning_gym", "math_verify", "humaneval")



def is_task_verifier(name: str) -> bool:
    """Whether the scorer `name` (a spec's `task.name`, a source's `verifier`) scores with `verify_detail`: a
    built-in, a name registered as a task family or verifier, or the import path of a task family (not that of
    an environment)."""
    return name in TASK_VERIFIERS or _resolves_to_a_verifier(name)


def _resolves_to_a_verifier(name: str) -> bool:
    if ":" not in name:  # the built-ins' ops ("add", "word") are no scorer names: TASK_VERIFIERS holds those
        return not VERIFIERS.is_builtin(name) and (name in TASK_FAMILIES or name in VERIFIERS)
    try:
        family_named(name)
    except ValueError:  # not importable, or not a TaskFamily: an environment's path, say
        return False
    return True


def verifier_for(problem: Problem) -> Verifier:
    """The verifier of `problem`: the one registered for its op, else that of the task family its op names, else
    the exact arithmetic check (rows of any other op)."""
    op = problem.op
    return VERIFIERS.get(op) if VERIFIERS.is_builtin(op) else _find_verifier(op)


def _find_verifier(op: str) -> Verifier:
    if op in VERIFIERS:
        return VERIFIERS.get(op)
    # the built-in families' problems carry built-in ops ("word", "code"); another op is no name of theirs
    if ":" not in op and not TASK_FAMILIES.is_builtin(op) and op in TASK_FAMILIES:
        return TASK_FAMILIES.get(op).verifier
    return VERIFIERS.get("arithmetic")


def runs_hack_detectors(problem: Problem, scorer: str | None = None) -> bool:
    """Whether scoring `problem` with `scorer` (None: the task's verifier) runs the reward-hack detectors: only the
    code verifiers have them, so a step of other problems has no hack count at all (not a count of 0)."""
    return (scorer is None or is_task_verifier(scorer)) and verifier_for(problem).detects_hacks


def verify_detail(completion: str, problem: Problem) -> tuple[float, frozenset[str]]:
    """`verify`'s reward and the hack detectors (`code_harness.HACK_FLAGS`) the completion tripped: a signal for
    the step's metrics, never part of the reward; only code verifiers have detectors (empty for the others)."""
    reward, flags = verifier_for(problem).detail(completion, problem)
    return _bounded(reward), frozenset(flags)


def verify(completion: str, problem: Problem) -> float:
    """The verifier's reward for one completion of `problem`, in [0, 1]; 0 for whatever the completion does.
    A sandbox pool that cannot isolate (`IsolationUnavailable`) or a malformed code problem (ValueError naming
    it) is not a completion's fault: those raise."""
    return verify_detail(completion, problem)[0]
