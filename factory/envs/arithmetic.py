"""The arithmetic task family: deterministic problems from a seed, disjoint splits, an exact verifier.

A problem is `"<a><op><b>="`; the answer is the decimal result, written least-significant digit
first when `reverse_answer` is set (the order in which carries are computed, which a small
transformer learns far more easily); `reverse_operands` writes the operands that way too, so each
answer digit sits at a fixed distance from the operand digits it depends on. Difficulty levels
are operand digit lengths.
"""

from __future__ import annotations

import random

from factory.config import TaskSpec
from factory.problem import Problem, Splits

OPS = {"add": "+", "sub": "-", "mul": "*"}


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0, 9) if digits == 1 else rng.randint(10 ** (digits - 1), 10**digits - 1)


def _problem(a: int, op: str, b: int, digits: int, reverse: bool, reverse_operands: bool = False) -> Problem:
    if op == "sub" and b > a:
        a, b = b, a  # keep results non-negative: the answer alphabet has no sign
    value = {"add": a + b, "sub": a - b, "mul": a * b}[op]
    answer = str(value)[::-1] if reverse else str(value)
    sa, sb = (str(a)[::-1], str(b)[::-1]) if reverse_operands else (str(a), str(b))
    prompt = f"{sa}{OPS[op]}{sb}="
    return Problem(id=f"{op}{digits}-{a}-{b}", prompt=prompt, answer=answer, op=op, digits=digits)


def arithmetic_capacity(operations: list[str], digits: list[int]) -> int:
    """How many distinct problems (ids) the operations and digit lengths allow: every ordered operand pair for
    add and mul, unordered pairs for sub (`_problem` puts the larger operand first)."""
    total = 0
    for d in set(digits):
        n = 10 if d == 1 else 9 * 10 ** (d - 1)  # operands of d digits (0-9 for one digit)
        for op in set(operations):
            total += n * (n + 1) // 2 if op == "sub" else n * n
    return total


def prompt_tokens(digits: list[int]) -> int:
    """Tokens of the longest prompt, `<bos>` + "<a><op><b>=" with operands of the most digits."""
    return 1 + 2 * max(digits) + 2


def make_splits(task: TaskSpec, seed: int) -> Splits:
    """Deterministic train and held-out splits that share no problem (same operands and operation).
    At most half of the distinct problems are drawn (spec validation enforces it): rejection sampling
    near the whole space would spend most draws on repeats."""
    rng = random.Random(f"arithmetic-{seed}")
    space = arithmetic_capacity(task.operations, task.digits)
    wanted = task.n_train + task.n_eval
    if wanted > space // 2:
        raise ValueError(
            f"task: n_train + n_eval = {wanted} is more than half of the {space} distinct problems "
            f"for operations={task.operations} digits={task.digits}; lower them or add digit lengths"
        )
    seen: set[tuple[str, int, int]] = set()
    problems: list[Problem] = []
    while len(problems) < wanted:
        op = rng.choice(task.operations)
        d = rng.choice(task.digits)
        p = _problem(_operand(rng, d), op, _operand(rng, d), d, task.reverse_answer, task.reverse_operands)
        if p.id in seen:
            continue
        seen.add(p.id)
        problems.append(p)
    return Splits(train=problems[task.n_eval :], eval=problems[: task.n_eval])


def reward_fn(prompt: str, completion: str, *, answer: str, **_: object) -> float:
    """The environment-protocol form of `reward` (`factory/envs/protocol.py`)."""
    return 1.0 if completion.strip() == answer else 0.0


def reward(completion: str, problem: Problem) -> float:
    """1.0 for the exact answer (surrounding whitespace ignored), else 0.0; never raises."""
    try:
        return 1.0 if completion.strip() == problem.answer else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0
