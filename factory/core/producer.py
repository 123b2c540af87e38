"""Rollout producers: where each trainer step's prompt groups come from, one class per loop mode.

- `SyncProducer` (mode `sync`): a batch is generated with the trainer's current weights, every
  episode of it runs in the environment at once, and the batch is ready when its slowest episode is.
  The engine shares the trainer's model object, so publishing a version is bumping a number.
- `OverlappedProducer` (modes `one_step_off`, `async`): producer threads keep prompt groups in
  flight on a continuous-batching engine that holds its own copy of the weights, and put scored
  groups into the rollout buffer; the trainer takes batches from the buffer. `one_step_off` is the
  buffer's `bound` policy at staleness 1 (generation of batch N+1 overlaps training of batch N);
  `async` uses the spec's buffer (depth, staleness policy) and has no batch barrier at all.

Both draw prompts from one deterministic `PromptStream` and the same simulated environment, so a
benchmark compares modes on identical work.
"""

from __future__ import annotations

import copy
import random
import threading
import time

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import BufferSpec, ExperimentSpec
from factory.core.buffer import BufferClosed, BufferTimeout, Group, RolloutBuffer, Sample
from factory.core.rollout.base import Completion, SamplingParams
from factory.core.rollout.continuous import ContinuousEngine
from factory.core.rollout.embedded import EmbeddedEngine
from factory.envs.arithmetic import Problem, reward
from factory.envs.latency import LatencyProfile


class ProducerFailed(RuntimeError):
    """A producer thread died; the trainer re-raises it instead of waiting forever."""


class PromptStream:
    """Draw k (k = 0, 1, ...) is always the same problem: no repeats within a block of `block` draws."""

    def __init__(self, problems: list[Problem], seed: int, block: int):
        self.problems, self.seed, self.block = problems, seed, block
        self._lock = threading.Lock()
        self._next = 0
        self._cache: dict[int, list[Problem]] = {}

    def draw(self) -> tuple[int, Problem]:
        with self._lock:
            k = self._next
            self._next += 1
            b, i = divmod(k, self.block)
            if b not in self._cache:
                self._cache = {b: random.Random(f"prompts-{self.seed}-{b}").sample(self.problems, self.block)}
            return k, self._cache[b][i]


def make_group(problem: Problem, k: int, completions: list[Completion], latency_s: float) -> Group:
    """Score the completions with the task's verifier into a buffer group."""
    samples = [Sample.from_completion(c, reward(c.text, problem)) for c in completions]
    return Group(samples, uid=f"draw-{k}", meta={"prompt_id": problem.id, "prompt": problem.prompt, "draw": k,
                                                 "latency_s": latency_s})


def _params(spec: ExperimentSpec, seed: int, n: int = 1) -> SamplingParams:
    r = spec.rollout
    return SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=seed)


def _latency(spec: ExperimentSpec) -> LatencyProfile | None:
    unit = spec.task.simulated_latency_s
    return LatencyProfile(unit_s=unit) if unit > 0 else None


class SyncProducer:
    """Generate → run every episode → return the batch; the engine samples from the trainer's model."""

    def __init__(self, spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                 stream: PromptStream, start_version: int):
        self.spec, self.tok, self.stream = spec, tokenizer, stream
        self.engine = EmbeddedEngine(model, tokenizer, weight_version=start_version)
        self.latency = _latency(spec)

    def next_batch(self, step: int) -> list[Group]:
        draws = [self.stream.draw() for _ in range(self.spec.rollout.prompts_per_step)]
        prompts = [self.tok(p.prompt).input_ids for _, p in draws]
        params = _params(self.spec, self.spec.seed * 1_000_003 + step, n=self.spec.algorithm.group_size)
        groups = self.engine.generate(prompts, params)
        waits = [self.latency.sample(f"{p.id}-{k}") if self.latency else 0.0 for k, p in draws]
        # The episodes run side by side in the environment: the batch is ready when the slowest is.
        time.sleep(max(waits))
        return [make_group(p, k, comps, w) for (k, p), comps, w in zip(draws, groups, waits, strict=True)]

    def publish(self, model: PreTrainedModel, version: int) -> None:
        self.engine.weight_version = version  # same model object: the weights are already there

    def probe(self, prompt_ids: list[int], n: int) -> list[Completion]:
        """`n` completions of one prompt from the engine's current weights (outside the training data)."""
        return self.engine.generate([prompt_ids], _params(self.spec, seed=0x7FFFFFFF, n=n))[0]

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class OverlappedProducer:
    """Producer threads → rollout buffer → trainer, with versioned weight updates into the engine."""

    def __init__(self, spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                 stream: PromptStream, start_version: int):
        self.spec, self.tok, self.stream = spec, tokenizer, stream
        per_step = spec.rollout.prompts_per_step
        buffer_spec = spec.buffer if spec.schedule.mode == "async" else BufferSpec(policy="bound", max_staleness=1)
        self.buffer = RolloutBuffer.from_spec(buffer_spec, groups_per_step=per_step)
        # The engine samples from its own copy: the trainer changes its weights only by publishing.
        rows = max(64, per_step * spec.algorithm.group_size)  # a whole step's samples decode together
        self.engine = ContinuousEngine(copy.deepcopy(model).eval(), tokenizer, weight_version=start_version,
                                       max_batch=rows).start()
        self.latency = _latency(spec)
        self.timeout = spec.schedule.wait_timeout_s
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._busy_s = 0.0  # summed over producers: time with a group in flight
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        n = spec.rollout.concurrency or self.buffer.capacity
        self._threads = [threading.Thread(target=self._produce, name=f"producer-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def _produce(self) -> None:
        g = self.spec.algorithm.group_size
        try:
            while not self._stop.is_set():
                try:
                    slot = self.buffer.reserve(timeout=0.5)  # short: re-check the stop flag while full
                except BufferTimeout:
                    continue
                t0 = time.perf_counter()
                k, problem = self.stream.draw()
                ids = self.tok(problem.prompt).input_ids
                params = _params(self.spec, self.spec.seed * 1_000_003 + k)
                futures = [self.engine.submit(ids, params, sample_index=j) for j in range(g)]
                completions = [f.result(timeout=self.timeout) for f in futures]
                wait = self.latency.sample(f"{problem.id}-{k}") if self.latency else 0.0
                if self._stop.wait(wait):  # the simulated environment; wakes at once on shutdown
                    slot.cancel()
                    return
                self.buffer.put(make_group(problem, k, completions, wait), reservation=slot)
                with self._lock:
                    self._busy_s += time.perf_counter() - t0
        except BufferClosed:
            return
        except BaseException as e:  # noqa: BLE001 - surfaced to the trainer by next_batch
            self._errors.append(e)
            self.buffer.close()

    def next_batch(self, step: int) -> list[Group]:
        try:
            return self.buffer.get_batch(self.spec.rollout.prompts_per_step, current_version=step,
                                         timeout=self.timeout)
        except (BufferClosed, BufferTimeout) as e:
            if self._errors:
                raise ProducerFailed(f"a rollout producer failed: {self._errors[0]!r}") from self._errors[0]
            raise e

    def publish(self, model: PreTrainedModel, version: int) -> None:
        # In-process transport: a tensor copy, applied by the engine between decode steps.
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.engine.update_weights(state, version, self.spec.rollout.update_mode).result(timeout=self.timeout)

    def probe(self, prompt_ids: list[int], n: int) -> list[Completion]:
        """`n` completions of one prompt at the engine's current version (the trainer waits on them; the
        only publisher is the trainer, so no update can land in between)."""
        params = _params(self.spec, seed=0x7FFFFFFF)
        futures = [self.engine.submit(prompt_ids, params, sample_index=j) for j in range(n)]
        return [f.result(timeout=self.timeout) for f in futures]

    def metrics(self) -> dict[str, float]:
        m = self.buffer.metrics()
        elapsed = time.perf_counter() - self._t0
        n = len(self._threads)
        with self._lock:
            m["producer_idle_fraction"] = max(0.0, 1.0 - self._busy_s / max(elapsed * n, 1e-9))
        return m

    def close(self) -> None:
        self._stop.set()
        self.buffer.close()
        for t in self._threads:
            t.join(timeout=self.timeout)
        self.engine.stop()


def make_producer(spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                  train: list[Problem], start_version: int) -> SyncProducer | OverlappedProducer:
    stream = PromptStream(train, spec.seed, spec.rollout.prompts_per_step)
    for _ in range(start_version * spec.rollout.prompts_per_step):  # a resumed run continues the sequence
        stream.draw()
    cls = SyncProducer if spec.schedule.mode == "sync" else OverlappedProducer
    return cls(spec, model, tokenizer, stream, start_version)

