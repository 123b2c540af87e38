"""A multi-turn tool-use environment in the arithmetic alphabet: the model may call a calculator tool.

Protocol (the character vocabulary has no room for JSON tool calls): a reply that ends with '=' and is
an expression of digits and + - * (e.g. `123+456=`) is a call of the calculator; the tool's result comes
back as the next user turn, and the model's following reply is its answer. Any other reply is the
answer itself. Reward 1 for the exact answer. The tool runs in the sandbox pool (`envs/sandbox.py`), like
any tool that executes code, after a strict parse of the expression that rebuilds it from integers
(`calculator_program`); `calculator` is the same arithmetic without a sandbox, for checking it.
"""

from __future__ import annotations

import re
from typing import Any

from factory.envs.protocol import EpisodeResult

_EXPR = re.compile(r"^\s*(\d+(?:[+\-*]\d+)*)=\s*$")
MAX_TOOL_CALLS = 2


def calculator_program(expression: str) -> str | None:
    """The Python program the tool runs for `expression` (numbers re-written from ints: no leading zeros, no
    names), or None when it is not an expression of the protocol."""
    m = _EXPR.match(expression)
    if not m:
        return None
    parts = re.split(r"([+\-*])", m.group(1))
    return "print(" + "".join(p if p in "+-*" else str(int(p)) for p in parts) + ")"


def run_tool(expression: str) -> str:
    """The calculator, executed in this process's sandbox pool; what the model sees back."""
    from factory.envs.tasks import sandbox_pool

    program = calculator_program(expression)
    if program is None:
        return "error"
    result = sandbox_pool().run(program)
    return result.stdout.strip() if result.ok else "error"


def calculator(expression: str) -> str:
    """The value of `a op b op c ...` (left to right, * before + and -), or an error message the model sees."""
    m = _EXPR.match(expression)
    if not m:
        return "error"
    terms = re.split(r"([+\-])", m.group(1))
    total, sign = 0, 1
    for term in terms:
        if term in "+-":
            sign = 1 if term == "+" else -1
            continue
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += sign * product
    return str(total)


async def calculator_episode(task: dict[str, Any], client: Any) -> EpisodeResult:
    """One episode: the problem's prompt as the user turn; up to MAX_TOOL_CALLS calculator calls; then the answer."""
    sampling = dict(task.get("sampling", {}))
    messages = [{"role": "user", "content": task["prompt"]}]
    calls = 0
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, **sampling)
        text = reply.choices[0].message.content or ""
        if calls < MAX_TOOL_CALLS and _EXPR.match(text):
            calls += 1
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": run_tool(text)}]
            continue
        reward = 1.0 if text.strip() == task["answer"] else 0.0
        return EpisodeResult(reward, info={"tool_calls": calls, "answer": text})
