"""Where episodes are scored, one class per medium: `LocalEnvironment` (threads of the trainer's process) and
`ServiceEnvironment` (environment-worker processes behind `envs/service.py`, supervised, over HTTP).

Both take a list of episodes that run side by side and return when the slowest is done, with the same
rewards and the same simulated latency for the same episode keys, so a benchmark compares media and loop
modes on identical environments. `score` returns None when the environment was closed meanwhile (the
producer is shutting down), never a partial result.

A sample whose environment failed (raised, hung past `task.reward_timeout_s` / `task.episode_timeout_s`, or
returned something other than a finite number; see `envs/protocol.py`) scores 0.0 with its reason, and the run
goes on; `metrics()["env_errors"]` counts such samples since the environment was made.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from factory.envs.latency import LatencyProfile
from factory.envs.protocol import REWARD_TIMEOUT_S, EpisodeResult, run_episodes_isolated
from factory.envs.registry import load_environment
from factory.envs.service import score_completions_detail
from factory.envs.tasks import configure_sandbox
from factory.infra import http_client
from factory.infra.supervisor import CONNECTION_ERRORS, ServiceProcess, ServiceUnavailable, retry
from factory.problem import Problem


@dataclass(frozen=True)
class Episode:
    key: str  # unique per episode; the simulated latency is drawn from it
    problem: Problem
    completions: list[str]
    env: str = "arithmetic"


@dataclass(frozen=True)
class Scored:
    rewards: list[float]
    reasons: list[str | None]  # None where scored normally; why the reward is 0 where the environment failed
    latency_s: float
    hacks: list[list[str]] = field(default_factory=list)  # per completion: reward-hack detectors it tripped


def _check_timeout(reward_timeout_s: float) -> None:
    if not 0 < reward_timeout_s < float("inf"):
        raise ValueError(f"task.reward_timeout_s: expected seconds > 0, got {reward_timeout_s!r}")


class _ErrorCount:
    def __init__(self) -> None:
        self.n, self._lock = 0, threading.Lock()

    def add(self, reasons: list[str | None]) -> None:
        with self._lock:  # producers score from several threads
            self.n += sum(1 for r in reasons if r is not None)


class LocalEnvironment:
    """Episodes run in the calling thread: wait out the slowest simulated latency, then score. A user's reward
    function runs in a helper thread so a hang returns at `reward_timeout_s`; the hung call is abandoned, not
    killed: its thread keeps running (and holding what it holds) until the call returns, if ever; after
    `protocol.MAX_HUNG_CALLS` such calls it is not called again (see `protocol.call_guarded`). Multi-turn
    episodes run on an event loop of their own, abandoned the same way if one blocks it."""

    def __init__(self, latency: LatencyProfile | None, reward_timeout_s: float = REWARD_TIMEOUT_S):
        _check_timeout(reward_timeout_s)
        self.latency, self.reward_timeout_s = latency, reward_timeout_s
        self._closed = threading.Event()
        self._errors = _ErrorCount()

    def score(self, episodes: list[Episode]) -> list[Scored] | None:
        waits = [self.latency.sample(ep.key) if self.latency else 0.0 for ep in episodes]
        if waits and self._closed.wait(max(waits)):  # wakes at once on shutdown
            return None
        out = []
        for ep, w in zip(episodes, waits, strict=True):
            rewards, reasons, hacks = score_completions_detail(ep.env, ep.problem.to_dict(), ep.completions,
                                                               self.reward_timeout_s)
            out.append(Scored(rewards, reasons, w, hacks))
        for s in out:
            self._errors.add(s.reasons)
        return out

    def run_episodes(self, env: str, tasks: list[dict], session_ids: list[str], rollout_url: str,
                     timeout_s: float) -> list[EpisodeResult] | None:
        """Multi-turn episodes of `env` against the rollout server at `rollout_url`, side by side, each bounded
        by `timeout_s`."""
        if self._closed.is_set():
            return None
        out = run_episodes_isolated(load_environment(env), tasks, session_ids, rollout_url, timeout_s)
        self._errors.add([e.reason for e in out])
        return out

    def metrics(self) -> dict[str, float]:
        return {"env_errors": float(self._errors.n)}

    def close(self) -> None:
        self._closed.set()


class ServiceEnvironment:
    """Episodes go to `processes` environment-worker processes (`factory env-serve`) on 127.0.0.1.

    A request is routed by its first episode's key, so a retry lands on the same process. If a worker
    process dies, it is restarted and the request is sent again whole (scoring is a pure function of the
    request), so no episode is lost or scored twice into the buffer. A worker restarted `breaker_restarts`
    times within `breaker_window_s` is not restarted again: the request raises `CircuitOpen` with its log tail.
    """

    def __init__(self, latency_unit_s: float = 0.0, processes: int = 1, timeout: float = 600.0,
                 max_connections: int = 256, workdir: str | Path | None = None, env: dict[str, str] | None = None,
                 breaker_restarts: int = 3, breaker_window_s: float = 60.0,
                 reward_timeout_s: float = REWARD_TIMEOUT_S, hang_timeout_s: float | None = None,
                 cpus: list[int] | None = None):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        _check_timeout(reward_timeout_s)
        self.timeout, self.max_connections = timeout, max_connections
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="factory-env-"))
        self._closed = threading.Event()
        self.services: list[ServiceProcess] = []
        self._clients: list[httpx.Client] = []
        self._retired: list[httpx.Client] = []
        self._errors = _ErrorCount()
        env = {**(env or {}), "FACTORY_REWARD_TIMEOUT_S": repr(float(reward_timeout_s))}
        try:
            for i in range(processes):
                svc = ServiceProcess(
                    f"env-worker-{i}",
                    [sys.executable, "-m", "factory.cli", "env-serve", "--port", "{port}",
                     "--latency-unit", repr(latency_unit_s)],
                    log_path=self.workdir / f"env-worker-{i}.log", startup_timeout=min(timeout, 120.0), env=env,
                    breaker_restarts=breaker_restarts, breaker_window_s=breaker_window_s,
                    hang_timeout_s=hang_timeout_s, cpus=cpus).start()
                self.services.append(svc)
                self._clients.append(self._client(svc))
        except BaseException:
            self.close()
            raise

    def _client(self, svc: ServiceProcess) -> httpx.Client:
        return http_client.client(base_url=svc.url, timeout=self.timeout,
                            limits=httpx.Limits(max_connections=self.max_connections))

    def score(self, episodes: list[Episode]) -> list[Scored] | None:
        if not episodes:
            return []
        body = {"episodes": [{"key": ep.key, "env": ep.env, "problem": ep.problem.to_dict(),
                              "completions": ep.completions} for ep in episodes]}
        out = self._post(episodes[0].key, "/score", body)
        if out is None:
            return None
        scored = [Scored(e["rewards"], e["reasons"], e["latency_s"], e.get("hacks") or []) for e in out["episodes"]]
        for s in scored:  # counted once per answered request: a repeated request's first try never answered
            self._errors.add(s.reasons)
        return scored

    def _post(self, route_key: str, path: str, body: dict) -> dict | None:
        i = zlib.crc32(route_key.encode()) % len(self.services)

        def post() -> dict | None:
            if self._closed.is_set():
                return None
            try:
                r = self._clients[i].post(path, json=body)
                r.raise_for_status()
                return r.json()
            except Exception:
                if self._closed.is_set():  # shutting down: whatever the half-closed client raised
                    return None
                raise

        def recover(attempt: int, error: BaseException) -> None:
            # One caller restarts it, with a fresh connection pool (the old one's keep-alive connections
            # went to the dead process); the others find it alive and retry on the new pool.
            if self.services[i].recover():
                self._retired.append(self._clients[i])
                self._clients[i] = self._client(self.services[i])

        return retry(post, attempts=3, on=CONNECTION_ERRORS, between=recover,
                     give_up=lambda e: ServiceUnavailable(f"{self.services[i].name}: 3 attempts failed; last: {e!r}"))

    def run_episodes(self, env: str, tasks: list[dict], session_ids: list[str], rollout_url: str,
                     timeout_s: float) -> list[EpisodeResult] | None:
        """As `LocalEnvironment.run_episodes`, in a worker process (which talks to the rollout server itself)."""
        out = self._post(session_ids[0], "/episodes", {"env": env, "tasks": tasks, "session_ids": session_ids,
                                                       "rollout_url": rollout_url, "timeout_s": timeout_s})
        if out is None:
            return None
        results = [EpisodeResult(e["reward"], e["reason"], e["info"]) for e in out["episodes"]]
        self._errors.add([e.reason for e in results])
        return results

    def metrics(self) -> dict[str, float]:
        return {"env_restarts": float(sum(s.restarts for s in self.services)), "env_errors": float(self._errors.n)}

    def worker_metrics(self) -> list[dict]:
        """Each worker process's own counters (episodes, in_flight, failures, pid)."""
        return [c.get("/metrics").json() for c in self._clients]

    def close(self) -> None:
        self._closed.set()
        for s in self.services:  # first: requests in flight end with a connection error, seen as closed
            s.stop()
        for c in (*self._clients, *self._retired):
            c.close()


def make_environment(latency_unit_s: float, medium: str, processes: int = 1, timeout: float = 600.0,
                     sandbox_workers: int = 4, sandbox_isolation: str = "bwrap", breaker_restarts: int = 3,
                     breaker_window_s: float = 60.0, reward_timeout_s: float = REWARD_TIMEOUT_S,
                     hang_timeout_s: float | None = None, env_cpus: list[int] | None = None,
                     sandbox_cpus: list[int] | None = None) -> LocalEnvironment | ServiceEnvironment:
    """Episodes in this process or in worker processes; either way generated code and tools run in a sandbox
    pool of `sandbox_workers` with `sandbox_isolation` (in the process that scores), and a user's reward
    function is bounded by `reward_timeout_s` per completion (`task.reward_timeout_s`). Worker processes are
    supervised with a circuit breaker (`ops.breaker_restarts` within `ops.breaker_window_s`) and a watchdog that
    kills one silent for `hang_timeout_s` (`ops.hang_timeout_s`). Placement: worker processes run on `env_cpus`
    (`rollout.env_cpus`; in-process scoring threads place themselves), sandboxes on `sandbox_cpus`."""
    if medium == "in_process":
        configure_sandbox(sandbox_workers, sandbox_isolation, sandbox_cpus)
        return LocalEnvironment(LatencyProfile(unit_s=latency_unit_s) if latency_unit_s > 0 else None,
                                reward_timeout_s=reward_timeout_s)
    if medium == "service":
        return ServiceEnvironment(latency_unit_s, processes=processes, timeout=timeout,
                                  env={"FACTORY_SANDBOX_SIZE": str(sandbox_workers),
                                       "FACTORY_SANDBOX_ISOLATION": sandbox_isolation,
                                       **({"FACTORY_SANDBOX_CPUS": ",".join(map(str, sandbox_cpus))}
                                          if sandbox_cpus else {})},
                                  cpus=env_cpus,
                                  breaker_restarts=breaker_restarts, breaker_window_s=breaker_window_s,
                                  reward_timeout_s=reward_timeout_s, hang_timeout_s=hang_timeout_s)
    raise ValueError(f"rollout.environment: expected 'in_process' or 'service', got {medium!r}")
