"""`OverlappedProducer` (modes `one_step_off`, `async`): producer threads keep prompt groups in flight on an
embedded engine (the paged one, or the continuous one for models it cannot run) that holds its own copy of the
weights, and put scored groups into the rollout buffer; the trainer takes batches from the buffer. `one_step_off` is
the buffer's `bound` policy at staleness 1 (generation of batch N+1 overlaps training of batch N); `async` uses the
spec's buffer (depth, staleness policy) and has no batch barrier at all."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import ExperimentSpec
from factory.core.buffer import BufferClosed, BufferTimeout, Group, Reservation, RolloutBuffer, Sample
from factory.core.producers.common import (
    encode_prompt,
    episode,
    make_group,
    open_environment,
    sampling_params,
    scorer,
)
from factory.core.rollout.engines.paged.engine import make_engine
from factory.core.rollout.engines.rounding import round_dtype, round_model_, rounded
from factory.data.feed import PromptFeed
from factory.infra.placement import enter, placements
from factory.infra.supervisor import ServiceUnavailable
from factory.models import lora
from factory.models.build import policy_positions
from factory.problem import Problem
from factory.protocols.engine import Completion, SamplingParams
from factory.protocols.producer import ProducerFailed
from factory.source_spec import SourceError


class OverlappedProducer:
    """Producer threads → rollout buffer → trainer, with versioned weight updates into the engine."""

    def __init__(self, spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                 feed: PromptFeed, start_version: int, state: dict | None = None):
        self.spec, self.tok, self.feed = spec, tokenizer, feed
        self.positions = policy_positions(spec.model, model)
        per_step = spec.rollout.prompts_per_step
        # async: the spec's buffer; one_step_off: a version of staleness at most (`spec.resolved`, worked out once)
        self.buffer = RolloutBuffer.from_spec(spec.resolved.buffer, groups_per_step=per_step)
        self.buffer.on_drop = lambda group: self.feed.dropped([group.meta["draw"]])
        if state is not None:  # scored groups not yet trained go back in; prompts in flight are served again
            self.buffer.load_state_dict(state["buffer"])
            feed.load_state_dict(state["stream"], buffered={g["meta"]["draw"] for g in state["buffer"]["groups"]})
        self.rows = max(64, per_step * spec.algorithm.group_size)  # a whole step's samples decode together
        self.timeout = spec.schedule.wait_timeout_s
        self._published = start_version  # the newest version the engine is known to hold (a lower bound)
        self.env = open_environment(spec)
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
        n = spec.resolved.concurrency
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
        ids = encode_prompt(self.tok, problem, self.spec, self.positions)
        completions = self._sample(ids, sampling_params(self.spec, self.spec.seed * 1_000_003 + k, n=g))
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
        return self._sample(prompt_ids, sampling_params(self.spec, seed=0x7FFFFFFF, n=n))

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


