"""What an environment is, in the two forms a user writes, and how the framework runs and reads them.

- Single turn: `reward(prompt: str, completion: str, **meta) -> float | RewardResult`.
- Multi turn: `async def run_episode(task: dict, client: openai.AsyncOpenAI) -> EpisodeResult | float`.
  The environment drives the conversation through `client` (pointed at the rollout server, its session
  already set by a default header) and never sees the trainer; the framework rebuilds the episode's exact
  tokens, logprobs and a loss mask over the model's own turns from the server's session record
  (`tokens_from_session`), so nothing is re-tokenized.
- Gym/OpenEnv style: an object with `reset(task) -> str` and `step(action: str) -> (obs, reward, done,
  info)`, wrapped by `GymAdapter` into a multi-turn episode (each observation is a user turn, each model
  reply an action).

`load_environment("name")` takes a built-in name (`BUILTINS`) or an import path `package.module:attr`.
`score_guarded` / `run_guarded` turn an environment that raises or times out into reward 0 with the reason
recorded, so one broken episode never stops a run.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass(frozen=True)
class RewardResult:
    reward: float
    reason: str = ""  # why the reward is what it is when the environment failed or refused
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeResult:
    reward: float
    reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)


class GymLike(Protocol):
    def reset(self, task: dict[str, Any]) -> str: ...
    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...


RewardFn = Callable[..., "float | RewardResult"]
EpisodeFn = Callable[[dict[str, Any], Any], Awaitable["EpisodeResult | float"]]


@dataclass(frozen=True)
class Environment:
    name: str
    kind: Literal["single_turn", "multi_turn"]
    reward: RewardFn | None = None
    run_episode: EpisodeFn | None = None


class GymAdapter:
    """A `reset`/`step` environment as a multi-turn episode: observations become user turns, replies actions."""

    def __init__(self, make_env: Callable[[], GymLike], max_turns: int = 8):
        self.make_env, self.max_turns = make_env, max_turns

    async def __call__(self, task: dict[str, Any], client: Any) -> EpisodeResult:
        env = self.make_env()
        obs = env.reset(task)
        messages = [{"role": "user", "content": obs}]
        total, info, turns = 0.0, {}, 0
        sampling = task.get("sampling", {})
        for turns in range(1, self.max_turns + 1):  # noqa: B007 - the count is reported
            reply = await client.chat.completions.create(model="policy", messages=messages, **sampling)
            action = reply.choices[0].message.content or ""
            obs, reward, done, info = env.step(action)
            total += float(reward)
            if done:
                break
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
        return EpisodeResult(total, info={**info, "turns": turns})


def _builtins() -> dict[str, Environment]:
    from factory.envs import arithmetic, tools

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


def score_guarded(env: Environment, prompt: str, completion: str, **meta: Any) -> RewardResult:
    """The single-turn reward; an environment that raises scores 0 with the reason."""
    try:
        out = env.reward(prompt, completion, **meta)
        return out if isinstance(out, RewardResult) else RewardResult(float(out))
    except Exception as e:  # noqa: BLE001 - a broken environment scores 0, the run goes on
        return RewardResult(0.0, f"{type(e).__name__}: {e}")


async def run_guarded(env: Environment, task: dict[str, Any], client: Any, timeout_s: float) -> EpisodeResult:
    """The multi-turn episode, bounded by `timeout_s`; raising or timing out scores 0 with the reason."""
    try:
        out = await asyncio.wait_for(env.run_episode(task, client), timeout_s)
        return out if isinstance(out, EpisodeResult) else EpisodeResult(float(out))
    except TimeoutError:
        return EpisodeResult(0.0, f"episode timed out after {timeout_s:g} s")
    except Exception as e:  # noqa: BLE001 - a broken environment scores 0, the run goes on
        if _infrastructure(e):
            raise  # the rollout server is gone: not the environment's fault; the caller retries the group
        return EpisodeResult(0.0, f"{type(e).__name__}: {e}")


def _infrastructure(e: BaseException) -> bool:
    try:
        import openai
    except ImportError:  # pragma: no cover - openai is a dependency
        return False
    return isinstance(e, openai.APIConnectionError)


async def run_episodes(env: Environment, tasks: list[dict[str, Any]], session_ids: list[str], rollout_url: str,
                       timeout_s: float) -> list[EpisodeResult]:
    """Episodes side by side, each with its own client on the rollout server, its session set by header."""
    import openai

    async def one(task: dict[str, Any], sid: str) -> EpisodeResult:
        async with openai.AsyncOpenAI(base_url=f"{rollout_url}/v1", api_key="unused", max_retries=0,
                                      timeout=timeout_s, default_headers={"x-session-id": sid}) as client:
            return await run_guarded(env, task, client, timeout_s)

    return list(await asyncio.gather(*(one(t, s) for t, s in zip(tasks, session_ids, strict=True))))


# ------------------------------------------------------------------ exact tokens from the session record


@dataclass(frozen=True)
class EpisodeTokens:
    prompt_ids: list[int]  # the first turn's prompt
    token_ids: list[int]  # everything after it: model turns and what the environment inserted
    logprobs: list[float]  # the sampler's, on model tokens; 0 elsewhere
    mask: list[int]  # 1 on the model's own tokens
    versions: list[int]  # weight versions that generated the model's tokens
    turns: int


def tokens_from_session(session: dict[str, Any]) -> EpisodeTokens:
    """The episode ending with the session's last turn, as one token stream: the chain of turns each continuing
    the exact ids of the previous one (`continues_turn`), so no token was re-tokenized. ValueError when the
    record is empty or a turn does not extend the one it claims to continue."""
    turns = session.get("turns") or []
    if not turns:
        raise ValueError(f"session {session.get('session_id')!r} has no turns")
    chain = [turns[-1]]
    while chain[-1].get("continues_turn") is not None:
        chain.append(turns[chain[-1]["continues_turn"]])
    chain.reverse()
    first, last = chain[0], chain[-1]
    full = list(last["prompt_ids"]) + list(last["completion_ids"])
    start = len(first["prompt_ids"])
    n = len(full) - start
    logprobs, mask, versions = [0.0] * n, [0] * n, set()
    for t in chain:
        lo = len(t["prompt_ids"]) - start
        ids = list(t["prompt_ids"]) + list(t["completion_ids"])
        if full[: len(ids)] != ids:
            raise ValueError(f"session {session.get('session_id')!r}: turn {t['turn']} does not extend the episode "
                             "(it was re-tokenized); cannot rebuild exact tokens")
        for i, lp in enumerate(t["logprobs"]):
            logprobs[lo + i], mask[lo + i] = float(lp), 1
        versions.update(int(v) for v in (t.get("token_versions") or [t["weight_version"]]))
    return EpisodeTokens(list(first["prompt_ids"]), full[start:], logprobs, mask,
                         sorted(versions) or [int(last["weight_version"])], len(chain))
