"""A multi-turn tool-use environment in the arithmetic alphabet: the model may call a calculator tool.

Protocol (the character vocabulary has no room for JSON tool calls): a reply that ends with '=' and is
an expression of digits and + - * (e.g. `123+456=`) is a call of the calculator; the tool's result comes
back as the next user turn, and the model's following reply is its answer. Any other reply is the
answer itself. Reward 1 for the exact answer. The tool runs in the sandbox pool (`envs/sandbox.py`), like
any tool that executes code, after a strict parse of the expression that rebuilds it from integers
(`calculator_program`); `calculator` is the same arithmetic without a sandbox, for checking it.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from factory.envs.protocol import EpisodeResult
from factory.envs.tasks import sandbox_pool, verify
from factory.problem import Problem

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


# ------------------------------------------------------------------ a python tool through OpenAI tool calls

PYTHON_TOOL = [{"type": "function", "function": {
    "name": "python", "description": "Run Python code in a sandbox and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}]
TOOL_OUTPUT_CHARS = 500  # what the model sees back of a tool's output


async def python_tool_episode(task: dict[str, Any], client: Any) -> EpisodeResult:
    """The task's prompt with a `python` tool offered through OpenAI tool calls (`tools=`); each call runs in the
    sandbox pool and its output (or error) comes back as a `tool` message; the first reply without a call is
    the answer, scored by the task family's verifier (`envs/tasks.py`). Meant for the text task families: tool
    output (newlines, letters) must be in the tokenizer's alphabet, which the arithmetic one is not."""
    sampling = dict(task.get("sampling", {}))
    problem = Problem(**{k: task[k] for k in ("id", "prompt", "answer", "op", "digits") if k in task},
                      meta=task.get("meta", {}))
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    calls = 0
    while True:
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=PYTHON_TOOL,
                                                     **sampling)
        msg = reply.choices[0].message
        if not msg.tool_calls or calls >= MAX_TOOL_CALLS:
            answer = msg.content or ""
            return EpisodeResult(verify(answer, problem), info={"tool_calls": calls, "answer": answer})
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            calls += 1
            try:
                code = json.loads(call.function.arguments).get("code", "")
            except (ValueError, AttributeError):
                code = None
            if not isinstance(code, str) or call.function.name != "python":
                out = f"error: unknown tool {call.function.name!r} or bad arguments"
            else:
                result = await asyncio.to_thread(sandbox_pool().run, code)
                out = result.stdout if result.ok else f"error: {result.reason}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out[:TOOL_OUTPUT_CHARS]})
