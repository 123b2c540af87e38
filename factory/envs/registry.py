"""Environments by name (`task.environment`, a source's `verifier`): `ENVIRONMENTS`, a `Registry` of the built-ins
(`BUILTINS`), environments registered in this process, plugins' entry points (group `factory.environments`) and
import paths `package.module:attr`, each wrapped as an `Environment` of factory/envs/protocol.py.

What a name resolves to may be an `Environment`, a single-turn reward function `reward(prompt, completion,
**meta)`, an `async def run_episode(task, client)`, or a class of reset/step environments (`GymAdapter`).
"""

from __future__ import annotations

import inspect

from factory.envs import arithmetic, tools
from factory.envs.protocol import Environment, GymAdapter
from factory.protocols.registry import Registry

ARITHMETIC = Environment("arithmetic", "single_turn", reward=arithmetic.reward_fn)
CALCULATOR_TOOL = Environment("calculator_tool", "multi_turn", run_episode=tools.calculator_episode)
PYTHON_TOOL = Environment("python_tool", "multi_turn", run_episode=tools.python_tool_episode)


def as_environment(name: str, obj: object) -> Environment:
    """`obj` as an `Environment` named `name`: as is, or wrapped by its form (see the module docstring)."""
    if isinstance(obj, Environment):
        return obj
    if inspect.isclass(obj) and hasattr(obj, "reset") and hasattr(obj, "step"):
        return Environment(name, "multi_turn", run_episode=GymAdapter(obj))
    if inspect.iscoroutinefunction(obj) or inspect.iscoroutinefunction(type(obj).__call__):
        return Environment(name, "multi_turn", run_episode=obj)
    if callable(obj):
        return Environment(name, "single_turn", reward=obj)
    raise ValueError(f"environment {name!r} is neither a reward function, an async run_episode, nor a reset/step "
                     f"class (got {type(obj).__name__})")


ENVIRONMENTS: Registry[Environment] = Registry(
    "environment", "environment",
    {"arithmetic": "factory.envs.registry:ARITHMETIC", "calculator_tool": "factory.envs.registry:CALCULATOR_TOOL",
     "python_tool": "factory.envs.registry:PYTHON_TOOL"},
    group="factory.environments", check=as_environment)

BUILTINS = ENVIRONMENTS.builtin_names()


def load_environment(name: str) -> Environment:
    """The environment `name` names (see the module docstring); a one-line ValueError naming it otherwise."""
    if ":" not in name and name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}: one of {', '.join(ENVIRONMENTS.names())}, or an import "
                         "path like 'my_pkg.my_env:run_episode' (or a plugin's entry point in group "
                         "'factory.environments')")
    return ENVIRONMENTS.get(name)
