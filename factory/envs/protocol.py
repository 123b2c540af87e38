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

Environments by name (the built-ins, ones registered in-process or by a plugin's entry point, or an import path
`package.module:attr`): `ENVIRONMENTS` and `load_environment` in factory/envs/registry.py.

Failure isolation: user code never stops a run. `score_all` / `score_guarded` (single turn) and `run_guarded` /
`run_episodes_isolated` (multi turn) score a sample 0.0 with a reason when its environment raises ("reward
raised ValueError: ..."), runs past its timeout ("reward timed out after 30s") or returns something that is not
a finite number ("reward returned 'abc' (str), expected a finite number"). Accepted: int, float, bool (True is
1.0: "is it right?" verifiers), numeric scalars (numpy, a one-element tensor), and `RewardResult` /
`EpisodeResult` holding one; refused: NaN, inf, str, None, lists and anything else. A result's `reason` is None
when the sample was scored normally; a reason the environment sets itself also marks the sample as not scored
normally (counted in `env_errors`).
"""

from __future__ import annotations

import asyncio
import math
import queue
import reprlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from factory.text import clip

T = TypeVar("T")

REWARD_TIMEOUT_S = 30.0  # TaskSpec.reward_timeout_s's default
# Reward calls abandoned at their timeout whose threads still run; past this many a reward function is not
# called again until some finish (each holds a thread and what it allocated: the leak is bounded).
MAX_HUNG_CALLS = 32
_REASON_CHARS = 300


@dataclass(frozen=True)
class RewardResult:
    reward: float
    reason: str | None = None  # why the sample was not scored normally (the environment failed or refused)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeResult:
    reward: float
    reason: str | None = None
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


# ------------------------------------------------------------------ checking what user code returns


def _number(value: Any) -> float | None:
    """`value` as a finite float, or None when it is not a finite number."""
    if isinstance(value, str | bytes) or not hasattr(type(value), "__float__"):
        return None
    try:
        x = float(value)
    except Exception:  # noqa: BLE001 - a multi-element array, a complex...: not a number
        return None
    return x if math.isfinite(x) else None


def _garbage(what: str, value: Any) -> str:
    return clip(f"{what} returned {reprlib.repr(value)} ({type(value).__name__}), expected a finite number",
                _REASON_CHARS, unit=None)


def _raised(what: str, e: BaseException) -> str:
    return clip(f"{what} raised {type(e).__name__}: {e}", _REASON_CHARS, unit=None)


def checked_reward(value: Any, what: str = "reward") -> RewardResult:
    """What an environment returned, as a result with a finite reward; 0.0 and the reason for anything else."""
    if isinstance(value, RewardResult | EpisodeResult):
        x = _number(value.reward)
        if x is None:
            return RewardResult(0.0, _garbage(what, value.reward), value.info)
        return RewardResult(x, value.reason or None, value.info)
    x = _number(value)
    return RewardResult(0.0, _garbage(what, value)) if x is None else RewardResult(x)


class _Refused(Exception):
    """An environment step returned something that is not a reward; the message is the sample's reason."""


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a daemon thread of its own, awaited: a blocking or hanging call of user code leaves the
    event loop free, so the episode's timeout can fire (the thread is then abandoned, not killed). Not the
    loop's default executor: its threads are joined at interpreter exit, which a hung call would block."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(value)

    def target() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this any more
            pass

    threading.Thread(target=target, daemon=True, name="factory-env-step").start()
    return await fut


class GymAdapter:
    """A `reset`/`step` environment as a multi-turn episode: observations become user turns, replies actions.
    `reset` and `step` run off the event loop, so one that hangs times out alone, not its group."""

    def __init__(self, make_env: Callable[[], GymLike], max_turns: int = 8):
        self.make_env, self.max_turns = make_env, max_turns

    async def __call__(self, task: dict[str, Any], client: Any) -> EpisodeResult:
        env = await _off_loop(self.make_env)
        obs = await _off_loop(env.reset, task)
        messages = [{"role": "user", "content": obs}]
        total, info, turns = 0.0, {}, 0
        sampling = task.get("sampling", {})
        for turns in range(1, self.max_turns + 1):  # noqa: B007 - the count is reported
            reply = await client.chat.completions.create(model="policy", messages=messages, **sampling)
            action = reply.choices[0].message.content or ""
            obs, reward, done, info = await _off_loop(env.step, action)
            if (x := _number(reward)) is None:
                raise _Refused(_garbage("episode step", reward))
            total += x
            if done:
                break
            messages += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
        return EpisodeResult(total, info={**info, "turns": turns})


# ------------------------------------------------------------------ running user code, guarded

_hung: set[threading.Thread] = set()
_hung_lock = threading.Lock()


def _hung_calls(add: threading.Thread | None = None) -> int:
    with _hung_lock:
        if add is not None:
            _hung.add(add)
        _hung.difference_update([t for t in _hung if not t.is_alive()])
        return len(_hung)


def _call(fn: Callable[[T], Any], item: T, what: str, catch: type[BaseException]) -> RewardResult:
    try:
        return checked_reward(fn(item), what)  # converting runs user code (__float__) too
    except catch as e:
        return RewardResult(0.0, _raised(what, e))


def _work(fn: Callable[[T], Any], items: Sequence[T], start: int, out: queue.SimpleQueue, stop: threading.Event,
          what: str) -> None:
    for i in range(start, len(items)):
        if stop.is_set():
            return
        out.put((i, _call(fn, items[i], what, BaseException)))  # even sys.exit() in a helper thread is a failure


def call_guarded(fn: Callable[[T], Any], items: Sequence[T], timeout_s: float | None,
                 what: str = "reward") -> list[RewardResult]:
    """`fn(item)` for each item in order, as checked rewards, each call bounded by `timeout_s`.

    `timeout_s=None`: called in this thread, unbounded (for the built-in verifiers, which bound themselves:
    code runs in the sandbox pool under its wall limit, and queueing for a sandbox worker is not a hang).

    The calls run one after another in a daemon helper thread while this thread waits with a deadline. A call
    past its deadline scores 0 ("reward timed out after 30s") and the rest go on in a fresh helper thread.
    What leaks: Python cannot kill a thread, so the abandoned one keeps running the hung call (its CPU, memory,
    open files and locks) until the call returns, if ever; being a daemon it never blocks interpreter exit.
    While `MAX_HUNG_CALLS` abandoned calls still run, further items are not called at all and score 0 with
    the reason. A call that holds the GIL without releasing it (a C extension) would stall this thread too;
    only a process boundary (env workers, the sandbox pool) guards against that."""
    if timeout_s is None:
        return [_call(fn, item, what, Exception) for item in items]  # Ctrl-C still stops the caller
    results: list[RewardResult | None] = [None] * len(items)
    i = 0
    while i < len(items):
        hung = _hung_calls()
        if hung >= MAX_HUNG_CALLS:
            why = f"{what} not called: {hung} earlier calls still run past their {timeout_s:g}s timeout"
            results[i:] = [RewardResult(0.0, why)] * (len(items) - i)
            break
        out: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()
        helper = threading.Thread(target=_work, args=(fn, items, i, out, stop, what), daemon=True,
                                  name=f"factory-{what}")
        helper.start()
        while i < len(items):
            try:
                j, result = out.get(timeout=timeout_s)
            except queue.Empty:
                results[i] = RewardResult(0.0, f"{what} timed out after {timeout_s:g}s")
                stop.set()
                _hung_calls(add=helper)
                i += 1
                break
            results[j] = result
            i = j + 1
    return results  # type: ignore[return-value] - every slot is filled above


def score_all(env: Environment, prompt: str, completions: Sequence[str], meta: dict[str, Any],
              timeout_s: float = REWARD_TIMEOUT_S) -> list[RewardResult]:
    """The single-turn environment's reward of each completion (`reward(prompt, completion, **meta)`), guarded
    by `call_guarded`: raising, hanging past `timeout_s` or returning garbage scores 0 with the reason."""
    return call_guarded(lambda c: env.reward(prompt, c, **meta), completions, timeout_s)


def score_guarded(env: Environment, prompt: str, completion: str, **meta: Any) -> RewardResult:
    """One completion's guarded single-turn reward, with the default timeout (`score_all` for a batch)."""
    return score_all(env, prompt, [completion], meta)[0]


async def run_guarded(env: Environment, task: dict[str, Any], client: Any, timeout_s: float) -> EpisodeResult:
    """The multi-turn episode, bounded by `timeout_s`; raising, timing out or returning something that is not a
    finite reward scores 0 with the reason. A lost connection to the rollout server is raised (not the
    environment's fault: the caller retries the group)."""
    try:
        out = await asyncio.wait_for(env.run_episode(task, client), timeout_s)
    except TimeoutError:
        return EpisodeResult(0.0, f"episode timed out after {timeout_s:g}s")
    except _Refused as e:
        return EpisodeResult(0.0, str(e))
    except Exception as e:  # noqa: BLE001 - a broken environment scores 0, the run goes on
        if _infrastructure(e):
            raise
        return EpisodeResult(0.0, _raised("episode", e))
    r = checked_reward(out, "episode")
    return EpisodeResult(r.reward, r.reason, r.info)


def _infrastructure(e: BaseException) -> bool:
    try:
        import openai  # noqa: PLC0415 - heavy (~1 s): only multi-turn episodes reach the rollout server
    except ImportError:  # pragma: no cover - openai is a dependency
        return False
    return isinstance(e, openai.APIConnectionError)


async def _run_one(env: Environment, task: dict[str, Any], sid: str, rollout_url: str,
                   timeout_s: float) -> EpisodeResult:
    import openai  # noqa: PLC0415 - heavy: as in _infrastructure

    async with openai.AsyncOpenAI(base_url=f"{rollout_url}/v1", api_key="unused", max_retries=0,
                                  timeout=timeout_s, default_headers={"x-session-id": sid}) as client:
        return await run_guarded(env, task, client, timeout_s)


async def run_episodes(env: Environment, tasks: list[dict[str, Any]], session_ids: list[str], rollout_url: str,
                       timeout_s: float) -> list[EpisodeResult]:
    """Episodes side by side, each with its own client on the rollout server, its session set by header."""
    return list(await asyncio.gather(*(_run_one(env, t, s, rollout_url, timeout_s)
                                       for t, s in zip(tasks, session_ids, strict=True))))


class _EpisodeRun:
    """Episodes on an event loop of their own in a daemon thread, their results kept as each one ends.

    `run_guarded`'s timeout can only fire while the loop runs; an `async def` episode that blocks it (sync I/O,
    `time.sleep`) would hold its group, and the caller, forever. Here the caller waits at most `backstop_s`
    and then scores the unfinished ones 0; the blocked thread is abandoned (it leaks until it returns)."""

    def __init__(self, env: Environment, tasks: list[dict[str, Any]], session_ids: list[str], rollout_url: str,
                 timeout_s: float, on_end: Callable[[], None] | None = None):
        if len(tasks) != len(session_ids):
            raise ValueError(f"{len(tasks)} tasks but {len(session_ids)} session_ids")
        self.timeout_s, self.n = timeout_s, len(tasks)
        # A live loop fires each timeout well before; the margin is wide because a loaded machine delays the loop's
        # own timer by seconds, and a late timer is not a blocked loop (it would be reported as one).
        self.backstop_s = timeout_s + max(5.0, 0.5 * timeout_s)
        self.done: dict[int, EpisodeResult] = {}
        self.error: BaseException | None = None
        self.ended = threading.Event()

        async def one(i: int) -> None:
            self.done[i] = await _run_one(env, tasks[i], session_ids[i], rollout_url, timeout_s)

        async def main() -> None:
            try:
                await asyncio.gather(*(one(i) for i in range(self.n)))
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                self.error = e
            finally:  # here, not after asyncio.run: its shutdown waits for executor threads a hang may hold
                self.ended.set()
                if on_end is not None:
                    on_end()

        threading.Thread(target=asyncio.run, args=(main(),), daemon=True, name=f"factory-episodes-{env.name}").start()

    def results(self) -> list[EpisodeResult]:
        if self.error is not None:
            raise self.error
        done = dict(self.done)
        late = EpisodeResult(0.0, f"episode timed out after {self.timeout_s:g}s (its event loop was blocked: "
                                  "blocking code in an async episode?)")
        return [done.get(i, late) for i in range(self.n)]


def run_episodes_isolated(env: Environment, tasks: list[dict[str, Any]], session_ids: list[str], rollout_url: str,
                          timeout_s: float) -> list[EpisodeResult]:
    """`run_episodes`, returning by the deadline even when an episode blocks its event loop (`_EpisodeRun`)."""
    run = _EpisodeRun(env, tasks, session_ids, rollout_url, timeout_s)
    run.ended.wait(run.backstop_s)
    return run.results()


async def run_episodes_isolated_async(env: Environment, tasks: list[dict[str, Any]], session_ids: list[str],
                                      rollout_url: str, timeout_s: float) -> list[EpisodeResult]:
    """`run_episodes_isolated` for a caller on an event loop (a server): awaits without holding a thread."""
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(ended.set)
        except RuntimeError:  # the caller's loop is gone
            pass

    run = _EpisodeRun(env, tasks, session_ids, rollout_url, timeout_s, on_end=wake)
    try:
        await asyncio.wait_for(ended.wait(), run.backstop_s)
    except TimeoutError:
        pass
    return run.results()


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
