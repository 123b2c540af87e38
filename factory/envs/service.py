"""Environment workers as a service: an HTTP API on 127.0.0.1 that runs episodes and returns their rewards.

`factory env-serve` starts it in its own process; the trainer's producers reach it through
`envs/workers.ServiceEnvironment`. One process runs many episodes side by side (asyncio): an episode's
latency (the verifier or agent time, simulated by `envs/latency.py` when configured) is awaited, and its
scoring runs in a worker thread so a slow verifier never blocks the others.

Endpoints:
- `GET /health` - 200 when ready.
- `GET /metrics` - {"episodes", "in_flight", "failures", "pid"}.
- `POST /score` - {"episodes": [{"key", "env", "problem", "completions"}]} -> {"episodes": [{"key",
  "rewards", "reasons", "hacks", "latency_s"}]}, in request order (`hacks`: per completion, the reward-hack
  detectors it tripped, `envs/code_harness.py`). All episodes of a request run concurrently, so
  a request takes as long as its slowest episode. Scoring is a pure function of the request (latency
  included, drawn from the episode key), so a client may repeat a request after a crash.
- `POST /episodes` - {"env", "tasks", "session_ids", "rollout_url", "timeout_s"} -> {"episodes": [{"reward",
  "reason", "info"}]}: multi-turn episodes (`envs/protocol.py`), each driving its own OpenAI client
  against the rollout server under its session id; the caller reads the exact tokens from the server.

An environment that raises, hangs or returns garbage scores 0 with the reason recorded (`envs/protocol.py`);
the run goes on. A user's reward function is bounded per completion by $FACTORY_REWARD_TIMEOUT_S (the spec's
`task.reward_timeout_s`, default 30), a multi-turn episode by the request's `timeout_s`.

A bad request is refused (`factory/infra/http_guard.py`): 422 naming the field for a malformed body, wrong types,
non-finite or out-of-range numbers, an unknown or single-turn environment in /episodes; 413 for a body over
`max_body_bytes`; 502 naming rollout_url when the rollout server cannot be reached. /score keeps scoring an
unknown env 0 with the reason, as the in-process environment does.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import openai
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, field_validator

from factory.envs.latency import LatencyProfile
from factory.envs.protocol import (
    REWARD_TIMEOUT_S,
    RewardResult,
    call_guarded,
    run_episodes_isolated_async,
    score_all,
)
from factory.envs.registry import load_environment
from factory.envs.tasks import TASK_VERIFIERS, is_task_verifier, verify_detail
from factory.infra.http_guard import MAX_JSON_BYTES, RequestError, guard
from factory.problem import Problem
from factory.text import clip

Scorer = Callable[[dict[str, Any], str], "float | RewardResult"]


def _task_verifier(problem: dict[str, Any], completion: str) -> RewardResult:
    reward, hacks = verify_detail(completion, Problem(**problem))
    return RewardResult(reward, info={"hacks": sorted(hacks)} if hacks else {})


# The task families' verifiers (envs/tasks.py; a registered family or verifier too, `is_task_verifier`); code
# rewards run in this process's sandbox pool.
SCORERS: dict[str, Scorer] = dict.fromkeys(TASK_VERIFIERS, _task_verifier)


MAX_EPISODE_TIMEOUT_S = 86400.0

# Requests are checked here (Factory's HTTP guard: a 4xx naming the field); NaN and infinities are refused.
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class EpisodeIn(BaseModel):
    model_config = _STRICT

    key: str = Field(description="names the episode; its simulated latency is drawn from it")
    env: str = "arithmetic"
    problem: dict[str, Any]
    completions: list[str]


class ScoreRequest(BaseModel):
    model_config = _STRICT

    episodes: list[EpisodeIn]


class EpisodesRequest(BaseModel):
    model_config = _STRICT

    env: str = Field(description="a built-in multi-turn environment or an import path package.module:attr")
    tasks: list[dict[str, Any]]
    session_ids: list[str]
    rollout_url: str = Field(description="the rollout server the episodes talk to (OpenAI API)")
    timeout_s: float = Field(300.0, gt=0, le=MAX_EPISODE_TIMEOUT_S)

    @field_validator("rollout_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"want an http(s) URL like http://127.0.0.1:8000, got {clip(v)!r}")
        return v


def score_completions(env: str, problem: dict[str, Any], completions: list[str],
                      timeout_s: float = REWARD_TIMEOUT_S) -> tuple[list[float], list[str | None]]:
    """Rewards and reasons of `score_completions_detail` (without the hack detectors)."""
    rewards, reasons, _ = score_completions_detail(env, problem, completions, timeout_s)
    return rewards, reasons


def score_completions_detail(env: str, problem: dict[str, Any], completions: list[str],
                             timeout_s: float = REWARD_TIMEOUT_S
                             ) -> tuple[list[float], list[str | None], list[list[str]]]:
    """Rewards and reasons (None when scored normally) from a task family's verifier, or from a user's single-turn
    reward function named by import path (`package.module:attr`, called as reward(prompt, completion,
    **problem fields), each call bounded by `timeout_s`); an unknown env, or a scorer that raises, hangs or
    returns something other than a finite number, gives 0 and why. Third: per completion, the reward-hack
    detectors a task family's code verifier saw it trip (`envs/code_harness.py`; empty elsewhere)."""
    scorer = SCORERS.get(env) or (_task_verifier if is_task_verifier(env) else None)
    if scorer is None and ":" in env:
        try:
            user = load_environment(env)
        except ValueError as e:
            return [0.0] * len(completions), [str(e)] * len(completions), [[] for _ in completions]
        if user.kind == "single_turn":
            results = score_all(user, problem.get("prompt", ""), completions,
                                {k: v for k, v in problem.items() if k != "prompt"}, timeout_s)
            return [r.reward for r in results], [r.reason for r in results], [[] for _ in completions]
    if scorer is None:
        why = f"unknown env {env!r}; known: {sorted(SCORERS)}"
        return [0.0] * len(completions), [why] * len(completions), [[] for _ in completions]
    results = call_guarded(lambda c: scorer(problem, c), completions, None)  # built-ins bound themselves
    return [r.reward for r in results], [r.reason for r in results], [list(r.info.get("hacks", ())) for r in results]


def create_app(latency: LatencyProfile | None = None, max_body_bytes: int = MAX_JSON_BYTES) -> FastAPI:
    app = guard(FastAPI(title="Factory environment workers"), validation_status=422, max_body_bytes=max_body_bytes)
    state = {"episodes": 0, "in_flight": 0, "failures": 0}
    reward_timeout_s = _reward_timeout()

    async def run(ep: EpisodeIn) -> dict[str, Any]:
        state["in_flight"] += 1
        try:
            wait = latency.sample(ep.key) if latency else 0.0
            if wait > 0:
                await asyncio.sleep(wait)
            rewards, reasons, hacks = await asyncio.to_thread(score_completions_detail, ep.env, ep.problem,
                                                              ep.completions, reward_timeout_s)
            state["episodes"] += 1
            state["failures"] += sum(1 for r in reasons if r)
            return {"key": ep.key, "rewards": rewards, "reasons": reasons, "hacks": hacks, "latency_s": wait}
        finally:
            state["in_flight"] -= 1

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict:
        return {**state, "pid": os.getpid()}

    @app.post("/score")
    async def score(body: ScoreRequest) -> dict:
        return {"episodes": list(await asyncio.gather(*(run(ep) for ep in body.episodes)))}

    @app.post("/episodes")
    async def episodes(body: EpisodesRequest) -> dict:
        if len(body.tasks) != len(body.session_ids):
            raise RequestError(422, f"session_ids: {len(body.tasks)} tasks but {len(body.session_ids)} session_ids",
                               "session_ids")
        try:
            env = load_environment(body.env)
        except ValueError as e:
            raise RequestError(422, f"env: {clip(str(e), 300)}", "env") from e
        if env.kind != "multi_turn":
            raise RequestError(422, f"env: environment {clip(body.env)!r} is single-turn; POST /score scores "
                                    f"completions", "env")
        state["in_flight"] += len(body.tasks)
        try:
            out = await run_episodes_isolated_async(env, body.tasks, body.session_ids, body.rollout_url,
                                                    body.timeout_s)
        except openai.APIConnectionError as e:  # not the request's shape, nor a bug here: the upstream is gone
            raise RequestError(502, f"rollout_url: cannot reach the rollout server at {clip(body.rollout_url)}: "
                                    f"{clip(str(e))}", "rollout_url", "upstream_unavailable") from e
        finally:
            state["in_flight"] -= len(body.tasks)
        state["episodes"] += len(out)
        state["failures"] += sum(1 for e in out if e.reason)
        return {"episodes": [{"reward": e.reward, "reason": e.reason, "info": e.info} for e in out]}

    return app


def _reward_timeout() -> float:
    raw = os.environ.get("FACTORY_REWARD_TIMEOUT_S", str(REWARD_TIMEOUT_S))
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or not value < float("inf"):
        raise ValueError(f"FACTORY_REWARD_TIMEOUT_S: expected seconds > 0, got {raw!r}")
    return value


def serve(host: str = "127.0.0.1", port: int = 8100, latency_unit_s: float = 0.0, log_level: str = "warning",
          max_body_bytes: int = MAX_JSON_BYTES) -> None:
    """Serve environment workers in the foreground until interrupted (the `factory env-serve` command)."""
    latency = LatencyProfile(unit_s=latency_unit_s) if latency_unit_s > 0 else None
    uvicorn.run(create_app(latency, max_body_bytes), host=host, port=port, log_level=log_level, lifespan="off")
