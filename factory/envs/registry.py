"""Environments by name: the built-ins (`BUILTINS`) and user environments at an import path
`package.module:attr`, each wrapped as an `Environment` of factory/envs/protocol.py."""

from __future__ import annotations

import importlib
import inspect

from factory.envs import arithmetic, tools
from factory.envs.protocol import Environment, GymAdapter


def _builtins() -> dict[str, Environment]:
    return {
        "arithmetic": Environment("arithmetic", "single_turn", reward=arithmetic.reward_fn),
        "calculator_tool": Environment("calculator_tool", "multi_turn", run_episode=tools.calculator_episode),
        "python_tool": Environment("python_tool", "multi_turn", run_episode=tools.python_tool_episode),
    }


BUILTINS = ("arithmetic", "calculator_tool", "python_tool")


def load_environment(name: str) -> Environment:
    """A built-in environment by name, or one at an import path `package.module:attr` (a reward function, an
    `async def run_episode(task, client)`, or a class/factory of reset/step environments)."""
    if ":" not in name:
        builtins = _builtins()
        if name not in builtins:
            raise ValueError(f"unknown environment {name!r}: a built-in ({', '.join(BUILTINS)}) or an import "
                             "path like 'my_pkg.my_env:run_episode'")
        return builtins[name]
    module, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"environment {name!r}: cannot import {attr!r} from {module!r}: {e}") from e
    if inspect.isclass(obj) and hasattr(obj, "reset") and hasattr(obj, "step"):
        return Environment(name, "multi_turn", run_episode=GymAdapter(obj))
    if inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(type(obj).__call__):
        return Environment(name, "multi_turn", run_episode=obj)
    if callable(obj):
        return Environment(name, "single_turn", reward=obj)
    raise ValueError(f"environment {name!r} is neither a reward function, an async run_episode, nor a reset/step "
                     f"class (got {type(obj).__name__})")
