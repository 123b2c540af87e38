"""Rollout producers: where each trainer step's prompt groups come from, one class per loop mode.

- `SyncProducer` (mode `sync`): a batch is generated with the trainer's current weights, every
  episode of it runs in the environment at once, and the batch is ready when its slowest episode is.
  The engine shares the trainer's model object, so publishing a version is bumping a number (with
  `rollout.round_weights` it samples from its own rounded copy, refreshed at each publish: `rollout/rounding.py`).
- `OverlappedProducer` (modes `one_step_off`, `async`): producer threads keep prompt groups in
  flight on an embedded engine (the paged one, or the continuous one for models it cannot run) that holds its
  own copy of the weights, and put scored groups into the rollout buffer; the trainer takes batches from the
  buffer. `one_step_off` is the buffer's `bound` policy at staleness 1 (generation of batch N+1 overlaps
  training of batch N); `async` uses the spec's buffer (depth, staleness policy) and has no batch barrier at all.

Both draw prompts from one deterministic prompt feed (`data/feed.py`: the blend of the spec's sources and
its curriculum) and score episodes through one environment
medium (`envs/workers.py`: threads of this process, or environment-worker processes over HTTP, per
`rollout.environment`), so a benchmark compares modes on identical work. With `rollout.engine:
server` and `rollout.environment: service`, trainer, rollout server and environment workers are
three processes on loopback; the producer threads here only move requests between them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

import httpx
import openai
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import BufferSpec, ExperimentSpec
from factory.core.buffer import BufferClosed, BufferTimeout, Group, Reservation, RolloutBuffer, Sample
from factory.core.rollout.base import Completion, SamplingParams
from factory.core.rollout.embedded import EmbeddedEngine
from factory.core.rollout.paged.engine import make_engine
from factory.core.rollout.paged.serving import model_dtype, serving_dtype
from factory.core.rollout.rounding import round_dtype, round_model_, rounded
from factory.core.rollout.sequences import load_state_dict_into
from factory.core.weights import WeightSyncError, encode_delta, encode_full
from factory.core.weights.shared import SharedWeightsWriter
from factory.core.weights.staging import HostStaging
from factory.data.feed import PromptFeed
from factory.envs.protocol import tokens_from_session
from factory.envs.registry import load_environment
from factory.envs.tasks import runs_hack_detectors
from factory.envs.workers import Episode, Scored, make_environment
from factory.infra import http_client, spare
from factory.infra.device import host_copy, run_device
from factory.infra.placement import enter, placements
from factory.infra.supervisor import CONNECTION_ERRORS, ServiceProcess, ServiceUnavailable, retry
from factory.models import lora
from factory.models.build import policy_positions
from factory.models.checkpoint import remove_checkpoint, save_checkpoint
from factory.models.prompting import prompt_ids
from factory.problem import Problem
from factory.source_spec import SourceError


class ProducerFailed(RuntimeError):
    """A producer thread died; the trainer re-raises it instead of waiting forever."""


def episode(problem: Problem, k: int, completions: list[Completion], env: str = "arithmetic") -> Episode:
    return Episode(key=f"{problem.id}-{k}", problem=problem, completions=[c.text for c in completions], env=env)


def scorer(spec: ExperimentSpec, problem: Problem | None = None) -> str:
    """What scores single completions of `problem`: a user's single-turn environment if the spec names one, else
    the verifier its source names, else the task's."""
    if spec.task.environment:
        return spec.task.environment
    return (problem.meta.get("verifier") if problem is not None else None) or spec.task.name


def make_group(problem: Problem, k: int, completions: list[Completion], scored: Scored,
               scorer_name: str | None = None) -> Group:
    """A buffer group of the completions and the environment's rewards for them (with the reason where the
    environment failed to judge one and scored it 0). `scorer_name`: what scored them (None: the task's verifier);
    the group's `hack_checked` says whether the reward-hack detectors looked at them."""
    samples = [Sample.from_completion(c, r) for c, r in zip(completions, scored.rewards, strict=True)]
    for sample, reason in zip(samples, scored.reasons, strict=True):
        if reason is not None:
            sample.meta["reason"] = reason
    for sample, hacks in zip(samples, scored.hacks, strict=False):  # none from environments without detectors
        if hacks:
            sample.meta["hacks"] = list(hacks)
    return Group(samples, uid=f"draw-{k}", meta={"prompt_id": problem.id, "prompt": problem.prompt, "draw": k,
                                                 "latency_s": scored.latency_s, "source": problem.meta.get("source"),
                                                 "hack_checked": runs_hack_detectors(problem, scorer_name)})


def _params(spec: ExperimentSpec, seed: int, n: int = 1) -> SamplingParams:
    r = spec.rollout
    return SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=seed)


def _environment(spec: ExperimentSpec):
    return make_environment(spec.task.simulated_latency_s, spec.rollout.environment, spec.rollout.env_processes,
                            timeout=spec.schedule.wait_timeout_s, sandbox_workers=spec.task.sandbox_workers,
                            sandbox_isolation=spec.task.sandbox_isolation, breaker_restarts=spec.ops.breaker_restarts,
                            breaker_window_s=spec.ops.breaker_window_s, reward_timeout_s=spec.task.reward_timeout_s,
                            hang_timeout_s=spec.ops.hang_timeout_s, env_cpus=spec.rollout.env_cpus,
                            sandbox_cpus=spec.task.sandbox_cpus)


class SyncProducer:
    """Generate → run every episode → return the batch; the engine samples from the trainer's model."""

    def __init__(self, spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                 feed: PromptFeed, start_version: int, state: dict | None = None):
        self.spec, self.tok, self.feed = spec, tokenizer, feed
        self.positions = policy_positions(spec.model, model)
        if state is not None:  # nothing is buffered between sync steps: only the feed continues
            feed.load_state_dict(state["stream"])
        # rollout.round_weights: the engine samples from its own copy, rounded (LoRA merged in); else from the
        # trainer's model object itself
        self._round = round_dtype(spec.rollout.round_weights)
        sampler = model if self._round is None else round_model_(lora.merged_copy(model).eval(), self._round)
        self.engine = EmbeddedEngine(sampler, tokenizer, weight_version=start_version,
                                     precision=spec.trainer.precision)  # computes where the model is
        self.env = _environment(spec)

    def next_batch(self, step: int) -> list[Group]:
        draws = [self.feed.draw(step) for _ in range(self.spec.rollout.prompts_per_step)]
        prompts = [_prompt_ids(self.tok, p, self.spec, self.positions) for _, p in draws]
        params = _params(self.spec, self.spec.seed * 1_000_003 + step, n=self.spec.algorithm.group_size)
        groups = self.engine.generate(prompts, params)
        # The episodes run side by side in the environment: the batch is ready when the slowest is.
        scored = self.env.score([episode(p, k, comps, scorer(self.spec, p))
                                 for (k, p), comps in zip(draws, groups, strict=True)])
        if scored is None:
            raise ProducerFailed("the environment was closed while a batch was being scored")
        batch = [make_group(p, k, comps, sc, scorer(self.spec, p))
                 for (k, p), comps, sc in zip(draws, groups, scored, strict=True)]
        self.feed.trained(batch)
        return batch

    def state_dict(self) -> dict:
        """The feed's position (a resume point is taken between steps: nothing is in flight)."""
        return {"stream": self.feed.state_dict(), "buffer": None}

    def publish(self, model: PreTrainedModel, version: int) -> None:
        if self._round is not None:  # the engine's own copy: the trainer's new weights, rounded
            state = lora.merged_state(model) if lora.attached(model) else model.state_dict()
            load_state_dict_into(self.engine.model, rounded(state, self._round))
        self.engine.weight_version = version  # else the same model object: the weights are already there

    def probe(self, prompt_ids: list[int], n: int) -> list[Completion]:
        """`n` completions of one prompt from the engine's current weights (outside the training data)."""
        return self.engine.generate([prompt_ids], _params(self.spec, seed=0x7FFFFFFF, n=n))[0]

    def metrics(self) -> dict[str, float]:
        return {**self.env.metrics(), **self.feed.metrics()}

    def close(self) -> None:
        self.env.close()


class OverlappedProducer:
    """Producer threads → rollout buffer → trainer, with versioned weight updates into the engine."""

    def __init__(self, spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                 feed: PromptFeed, start_version: int, state: dict | None = None):
        self.spec, self.tok, self.feed = spec, tokenizer, feed
        self.positions = policy_positions(spec.model, model)
        per_step = spec.rollout.prompts_per_step
        buffer_spec = spec.buffer if spec.schedule.mode == "async" else BufferSpec(policy="bound", max_staleness=1)
        self.buffer = RolloutBuffer.from_spec(buffer_spec, groups_per_step=per_step)
        self.buffer.on_drop = lambda group: self.feed.dropped([group.meta["draw"]])
        if state is not None:  # scored groups not yet trained go back in; prompts in flight are served again
            self.buffer.load_state_dict(state["buffer"])
            feed.load_state_dict(state["stream"], buffered={g["meta"]["draw"] for g in state["buffer"]["groups"]})
        self.rows = max(64, per_step * spec.algorithm.group_size)  # a whole step's samples decode together
        self.timeout = spec.schedule.wait_timeout_s
        self._published = start_version  # the newest version the engine is known to hold (a lower bound)
        self.env = _environment(spec)
        try:
            self._start_engine(model, start_version)
        except BaseException:
            self.env.close()
            raise
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._busy_s = 0.0  # summed over producers: time with a group in flight
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        n = spec.rollout.concurrency or self.buffer.capacity
        self._threads = [threading.Thread(target=self._produce, name=f"producer-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def _start_engine(self, model: PreTrainedModel, version: int) -> None:
        # The engine samples from its own copy: the trainer changes its weights only by publishing. With LoRA the
        # copy is plain (adapters merged in), and the merger keeps the base weights of the adapted modules.
        self._merger = None
        self._round = round_dtype(self.spec.rollout.round_weights)
        if lora.attached(model):
            base = lora.base_state(model)
            self._merger = lora.AdapterMerger({f"{m}.weight": base[f"{m}.weight"] for m in lora.lora_layers(model)})
        # The copy stays on the trainer model's device, and the engine computes there: the paged engine where it
        # runs the model, else the continuous one (make_engine logs why).
        budget = self.spec.rollout.kv_budget_mb
        copy = lora.merged_copy(model).eval()
        if self._round is not None:
            round_model_(copy, self._round)
        self.engine = make_engine(copy, self.tok, weight_version=version,
                                  max_batch=self.rows, precision=self.spec.trainer.precision,
                                  kv_budget=None if budget is None else budget << 20,
                                  owns_model=True)  # the merged copy is the engine's own
        self.engine.start(functools.partial(enter, placements(self.spec)["rollout"]))

    def _produce(self) -> None:
        enter(placements(self.spec)["environment"])  # these threads score episodes in-process
        try:
            while not self._stop.is_set():
                try:
                    # dated no newer than the weights that will generate it: the bound's deadline
                    slot = self.buffer.reserve(timeout=0.5, version=self._published)  # short: re-check stop
                except BufferTimeout:
                    continue
                t0 = time.perf_counter()
                k, problem = self.feed.draw(self._published)
                group = self._group(k, problem, slot)
                if group is None:  # shutting down
                    slot.cancel()
                    return
                self.buffer.put(group, reservation=slot)
                with self._lock:
                    self._busy_s += time.perf_counter() - t0
        except BufferClosed:
            return
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by next_batch
            self._errors.append(e)
            self.buffer.close()

    def _group(self, k: int, problem: Problem, slot: Reservation) -> Group | None:
        """G single-turn completions of the problem, scored by the environment (None: shutting down)."""
        g = self.spec.algorithm.group_size
        ids = _prompt_ids(self.tok, problem, self.spec, self.positions)
        completions = self._sample(ids, _params(self.spec, self.spec.seed * 1_000_003 + k, n=g))
        slot.generated_at(min(Sample.from_completion(c, 0.0).oldest_version for c in completions))
        scored = self.env.score([episode(problem, k, completions, scorer(self.spec, problem))])
        return None if scored is None else make_group(problem, k, completions, scored[0], scorer(self.spec, problem))

    def next_batch(self, step: int) -> list[Group]:
        try:
            groups = self.buffer.get_batch(self.spec.rollout.prompts_per_step, current_version=step,
                                           timeout=self.timeout)
        except (BufferClosed, BufferTimeout) as e:
            if self._errors:
                first = self._errors[0]
                if isinstance(first, ServiceUnavailable | SourceError):  # say which service, or which file and line
                    raise first from e
                raise ProducerFailed(f"a rollout producer failed: {first!r}") from first
            raise e
        self.feed.trained(groups)
        return groups

    def state_dict(self) -> dict:
        """Buffered groups, then the feed (in that order: a group put in between is re-served, not lost)."""
        buffer = self.buffer.state_dict()
        return {"buffer": buffer, "stream": self.feed.state_dict()}

    def publish(self, model: PreTrainedModel, version: int) -> None:
        # In-process handoff: the engine cast-copies the trainer's live tensors into its own parameters between
        # decode steps (one copy per tensor, tied ones once; no clone first). The trainer is the caller and waits
        # here until the copy is done, so it cannot step while the engine reads its weights, in either update mode
        # ("finish_old" waits for the old weights' sequences first). With LoRA only the adapters leave the trainer;
        # they are merged into the base copy here, on the rollout side.
        # rollout.round_weights: what is handed over is rounded (fresh tensors; the engine's own are already so).
        if self._merger is not None:
            merged = self._merger.merge(lora.adapter_state(model))
            if self._round is not None:
                merged = rounded(merged, self._round)
            state = {**self.engine.model.state_dict(), **merged}  # the rest: the engine's own tensors, not copied
        else:
            state = model.state_dict()  # views of the live parameters
            if self._round is not None:
                state = rounded(state, self._round)
        _handed_over(self.engine.update_weights(state, version, self.spec.rollout.update_mode), self.timeout)
        self._published = version

    def _sample(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        """`params.n` completions of one prompt (sample j seeded by (params.seed, j))."""
        futures = self.engine.submit_many([(prompt_ids, j) for j in range(params.n)], params)  # one group: shared K/V
        return [f.result(timeout=self.timeout) for f in futures]

    def probe(self, prompt_ids: list[int], n: int) -> list[Completion]:
        """`n` completions of one prompt at the engine's current version (the trainer waits on them; the
        only publisher is the trainer, so no update can land in between)."""
        return self._sample(prompt_ids, _params(self.spec, seed=0x7FFFFFFF, n=n))

    def metrics(self) -> dict[str, float]:
        m = {**self.buffer.metrics(), **self.env.metrics(), **self.feed.metrics()}
        elapsed = time.perf_counter() - self._t0
        n = len(self._threads)
        with self._lock:
            m["producer_idle_fraction"] = max(0.0, 1.0 - self._busy_s / max(elapsed * n, 1e-9))
        return m

    def close(self) -> None:
        self._stop.set()
        self.buffer.close()
        self.env.close()
        for t in self._threads:
            t.join(timeout=self.timeout)
        self._stop_engine()

    def _stop_engine(self) -> None:
        self.engine.stop()


class ServerProducer(OverlappedProducer):
    """As `OverlappedProducer`, but the engine is a rollout server in its own process (`factory serve`),
    reached over HTTP on 127.0.0.1 and supervised: if it dies, it is restarted, the trainer's last
    published weights are pushed to it in full, and the interrupted groups are requested again whole.
    A group enters the buffer only once complete (keyed by its draw), so none is lost or counted twice.
    Weights travel by `rollout.weight_transport` (`weight_transport`): "shared", a `SharedWeightsWriter` whose handle
    the server attaches once (again after a restart, when it reads the newest version instead of a full push), each
    version a cast-copy into it and one small POST; or "codec", lossless deltas (`core/weights`) against the version
    the server holds."""

    def _start_engine(self, model: PreTrainedModel, version: int) -> None:
        self._workdir = Path(tempfile.mkdtemp(prefix="factory-rollout-"))
        # With LoRA the server starts from the base weights and receives only adapters (merged there: its
        # UpdateDecoder), the current ones pushed as soon as it is up.
        save_checkpoint(lora.base_copy(model) if lora.attached(model) else model, self.tok, self._workdir / "initial")
        self._version = version
        self._shared: SharedWeightsWriter | None = None
        self._state: dict | None = None
        if weight_transport(self.spec) == "shared":  # the server reads versions from this buffer, in its dtype
            self._shared = shared_writer(self.spec, model)
            self._shared.publish(model.state_dict(), version)
        else:
            self._state = _published_state(model, self._staging)
        self._restart_lock = threading.RLock()  # publish holds it and may restart inside
        try:
            self.service = ServiceProcess(
                "rollout-server", server_argv(self.spec, self._workdir / "initial", self.rows, version),
                log_path=self._workdir / "server.log", startup_timeout=self.timeout,
                breaker_restarts=self.spec.ops.breaker_restarts, breaker_window_s=self.spec.ops.breaker_window_s,
                hang_timeout_s=self.spec.ops.hang_timeout_s, cpus=self.spec.rollout.cpus,
                spare=spare.take()).start()  # a warm process where the attempt was forked warm (runs/standby.py)
        except BaseException:
            if self._shared is not None:
                self._shared.close()
            raise
        self._retired: list[httpx.Client] = []
        self._renew_client()
        if self._shared is not None:
            self._call(self._attach)  # the handle goes once; after a restart `_push` sends it again
        if lora.attached(model):
            self._call(self._push)

    def _renew_client(self) -> None:
        # A fresh connection pool: the old one's keep-alive connections went to the dead process, and a
        # retry that picked one would fail again. Requests still running on the old client finish or fail
        # there; it is closed with the producer.
        if getattr(self, "_http", None) is not None:
            self._retired.append(self._http)
        self._http = http_client.client(base_url=self.service.url, timeout=self.timeout,
                                  limits=httpx.Limits(max_connections=max(100, len(getattr(self, "_threads", ())) + 8)))

    def _call(self, fn):
        """Run an HTTP call; through a server crash, restart it, re-send the weights, and run it again."""
        return retry(fn, attempts=3, on=CONNECTION_ERRORS, between=self._recover,
                     give_up=lambda e: ServiceUnavailable(f"rollout server: 3 attempts failed; last: {e!r}"))

    def _recover(self, attempt: int, error: BaseException) -> None:
        with self._restart_lock:  # one thread restarts and re-syncs; the others wait, then retry
            if self.service.recover():
                self._renew_client()
                self._push()

    def _push(self) -> None:
        """Send the whole current state (after a restart, the server is back at its initial weights); with the
        shared buffer, attach it again and let the server read the newest version from it."""
        if self._shared is not None:
            self._attach()
            self._apply_shared(self._version)
            return
        update = encode_full(self._state, self._version)
        r = self._http.post("/update_weights_from_delta", content=bytes(update.to_bytes()),
                            params={"version": self._version, "mode": self.spec.rollout.update_mode})
        r.raise_for_status()

    def post(self, path: str, body: dict) -> dict:
        """POST `body` to the server's `path` and return its JSON, through a server crash as `_call` does (the
        step-0 gate asks the chat endpoint this way)."""
        def once() -> dict:
            r = self._http.post(path, json=body)
            r.raise_for_status()
            return r.json()

        return self._call(once)

    def _sample(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        out = self.post("/v1/completions", {"prompt": prompt_ids, "n": params.n, "max_tokens": params.max_new_tokens,
                                            "temperature": params.temperature, "top_p": params.top_p,
                                            "seed": params.seed})
        return [Completion(prompt_ids=c["prompt_token_ids"], token_ids=c["token_ids"], logprobs=c["token_logprobs"],
                           text=c["text"], finish_reason=c["finish_reason"], weight_version=c["weight_version"],
                           token_versions=c["token_versions"]) for c in out["choices"]]

    @functools.cached_property
    def _staging(self) -> HostStaging:
        """Host buffers for versions that leave the process through the codec, in the dtype the engine serves
        (bf16 for trainer.precision bf16 on CUDA: the server's deltas are then against its own bf16 weights)."""
        dtype = serving_dtype(run_device(self.spec.resolved), self.spec.resolved.precision, torch.float32)
        return HostStaging(None if dtype == torch.float32 else dtype)  # fp32: the tensors as they are

    def _attach(self) -> None:
        r = self._http.post("/attach_shared_weights", json=self._shared.handle())
        r.raise_for_status()

    def _apply_shared(self, version: int) -> None:
        """Have the server apply the shared buffer's newest version, which must be `version`."""
        params = {"mode": self.spec.rollout.update_mode}
        r = self._http.post("/update_weights_from_shared", params=params)
        if r.status_code == 409:  # a server that never saw the handle (restarted without `_recover`)
            self._attach()
            r = self._http.post("/update_weights_from_shared", params=params)
        r.raise_for_status()
        if (served := r.json()["weight_version"]) != version:
            raise WeightSyncError(f"the rollout server serves version {served} after reading the shared buffer, "
                                  f"version {version} was published")

    def publish(self, model: PreTrainedModel, version: int) -> None:
        if self._shared is not None:
            with self._restart_lock:
                self._shared.publish(model.state_dict(), version)
                self._version = version
                self._call(lambda: self._apply_shared(version))
            self._published = version
            return
        new = _published_state(model, self._staging)
        update = encode_delta(self._state, new, version, base_version=self._version)

        def post() -> None:
            r = self._http.post("/update_weights_from_delta", content=bytes(update.to_bytes()),
                                params={"version": version, "mode": self.spec.rollout.update_mode})
            if r.status_code == 409:  # the server holds another base (e.g. it was restarted): send it all
                self._state, self._version = new, version
                self._push()
                return
            r.raise_for_status()

        with self._restart_lock:
            self._call(post)
            self._state, self._version = new, version
        self._published = version

    @functools.cached_property
    def _episodic(self) -> bool:
        """Whether the spec's environment runs multi-turn episodes (looked up once, not per group)."""
        env = self.spec.task.environment
        return env is not None and load_environment(env).kind == "multi_turn"

    def _group(self, k: int, problem: Problem, slot: Reservation) -> Group | None:
        if not self._episodic:
            return super()._group(k, problem, slot)
        return self._episode_group(k, problem, slot)

    def _episode_group(self, k: int, problem: Problem, slot: Reservation) -> Group | None:
        """G multi-turn episodes of the problem: the environment drives each against this server under its own
        session; the exact tokens, logprobs and the mask of the model's turns come back from the session
        records. If the server dies meanwhile, it is restarted and the whole group runs again (new sessions)."""
        r, g = self.spec.rollout, self.spec.algorithm.group_size
        tasks = [{**problem.to_dict(), "sampling": {"temperature": r.temperature, "top_p": r.top_p,
                                                    "max_tokens": r.max_new_tokens,
                                                    "seed": (self.spec.seed * 1_000_003 + k) * 1009 + j}}
                 for j in range(g)]
        tries = itertools.count(1)
        sids: list[str] = []  # the sessions of the attempt in flight
        errors = (*CONNECTION_ERRORS, openai.APIConnectionError, httpx.HTTPStatusError)

        def episodes() -> tuple[list, list[dict]] | None:
            attempt = next(tries)
            sids[:] = [f"draw-{k}-{j}-try{attempt}" for j in range(g)]
            try:
                results = self.env.run_episodes(self.spec.task.environment, tasks, sids, self.service.url,
                                                self.spec.task.episode_timeout_s)
                return None if results is None else (results, [self._session(sid) for sid in sids])
            except errors:
                if self._stop.is_set():
                    return None
                raise

        def recover(attempt: int, error: BaseException) -> None:
            self._recover(attempt, error)  # sessions live in the server: after a restart they are gone
            self._end_sessions(sids)  # after the recovery: through the new server's client

        try:
            out = retry(episodes, attempts=3, on=errors, between=recover,
                        give_up=lambda e: ServiceUnavailable(f"episodes of draw {k}: 3 attempts failed; last: {e!r}"))
        finally:
            self._end_sessions(sids)
        if out is None:
            return None
        results, records = out
        tokens = [tokens_from_session(rec) for rec in records]
        slot.generated_at(min(min(t.versions) for t in tokens))
        samples = [Sample(t.prompt_ids, t.token_ids, t.logprobs, res.reward, t.versions,
                          {"text": str(res.info.get("answer", "")), "reason": res.reason, "turns": t.turns},
                          mask=t.mask) for t, res in zip(tokens, results, strict=True)]
        return Group(samples, uid=f"draw-{k}", meta={"prompt_id": problem.id, "prompt": problem.prompt, "draw": k,
                                                     "latency_s": 0.0, "source": problem.meta.get("source"),
                                                     "hack_checked": False})  # episodes have no hack detectors

    def _end_sessions(self, sids: list[str]) -> None:
        for sid in sids:
            with contextlib.suppress(*CONNECTION_ERRORS):
                self._http.delete(f"/sessions/{sid}")

    def _session(self, sid: str) -> dict:
        resp = self._http.get(f"/sessions/{sid}")
        resp.raise_for_status()  # 404: the server lost it (restarted); the group is run again
        return resp.json()

    def _stop_engine(self) -> None:
        self.service.stop()
        for client in (self._http, *self._retired):
            client.close()
        if self._shared is not None:
            self._shared.close()
        remove_checkpoint(self._workdir / "initial")  # the small server.log stays for post-mortems


def server_argv(spec: ExperimentSpec, checkpoint: Path, rows: int, version: int) -> list[str]:
    """The `factory serve` command of a run's rollout server (`{port}` filled in by the supervisor): it serves
    `checkpoint` on the run's device, in the trainer's precision."""
    budget = [] if spec.rollout.kv_budget_mb is None else ["--kv-budget-mb", str(spec.rollout.kv_budget_mb)]
    return [sys.executable, "-m", "factory.cli", "serve", "--checkpoint", str(checkpoint), "--port", "{port}",
            "--threads", str(spec.rollout.threads or 1), "--max-batch", str(rows), "--weight-version", str(version),
            "--device", str(run_device(spec.resolved)), "--precision", spec.resolved.precision, *budget]


def _handed_over(update: Future, timeout: float) -> None:
    """Wait for an in-process update to be applied. Past `timeout` it is withdrawn if the engine has not begun
    copying (the trainer's tensors are about to change), else waited for to the end: it never reads a half-stepped
    state."""
    try:
        update.result(timeout=timeout)
    except FuturesTimeout:
        if update.cancel():
            raise TimeoutError(f"the rollout engine did not apply the weight update within {timeout:.0f}s "
                               f"(schedule.wait_timeout_s); it was withdrawn") from None
        update.result(timeout=timeout)  # the copy has begun: it takes about a copy of the weights


def weight_transport(spec: ExperimentSpec) -> str:
    """How a run's versions reach its rollout server: `rollout.weight_transport`, auto resolved ("shared" where the
    run computes on CUDA, unless LoRA adapters are what travels; "codec" otherwise)."""
    setting = spec.rollout.weight_transport
    if setting != "auto":
        return setting
    return "shared" if run_device(spec.resolved).type == "cuda" and spec.trainer.lora is None else "codec"


def shared_writer(spec: ExperimentSpec, model: PreTrainedModel) -> SharedWeightsWriter:
    """The shared buffer of a run's versions: on the run's device (the server's), in the dtype the server serves."""
    device = run_device(spec.resolved)
    return SharedWeightsWriter.create(model.state_dict(), serving_dtype(device, spec.trainer.precision,
                                                                         model_dtype(model)), device)


def _published_state(model: PreTrainedModel, staging: HostStaging | None = None) -> dict:
    """What a version sends the rollout server: a host copy of the weights, or with LoRA of the adapters alone.
    `staging` (`ServerProducer._staging`): buffers kept between versions, pinned from a GPU, one sync per
    version, tied weights once, in the dtype the server serves; it alternates two sets, so the copy before (the
    delta's base) stays whole while this one is written. Without it, fresh copies as they are."""
    if lora.attached(model):
        return lora.adapter_state(model)  # already fresh CPU copies
    if staging is None:
        return {k: host_copy(v) for k, v in model.state_dict().items()}
    return staging.snapshot(model.state_dict())


def _prompt_ids(tok: PreTrainedTokenizerFast, problem: Problem, spec: ExperimentSpec,
                limit: int | None) -> list[int]:
    """The prompt's tokens; a prompt too long for the model's `limit` positions (a file source's row) or that the
    tokenizer cannot read is an error naming it."""
    # SourceErrors: a row of the data the run cannot use, which a restart would meet again (bad input, exit 2)
    try:
        ids = prompt_ids(tok, problem.prompt)
    except Exception as e:  # a character tokenizer meets a character it does not have
        raise SourceError(f"prompt {problem.id!r} of source {problem.meta.get('source')!r} cannot be tokenized by the "
                          f"model's tokenizer (task {spec.task.name}'s alphabet): {e}") from None
    if limit is not None and len(ids) + spec.rollout.max_new_tokens > limit:
        raise SourceError(f"prompt {problem.id!r} of source {problem.meta.get('source')!r} has {len(ids)} tokens: "
                          f"with rollout.max_new_tokens = {spec.rollout.max_new_tokens} it does not fit the model's "
                          f"{limit} positions (raise model.max_positions, or filter the source)")
    return ids
