"""The paged rollout engine (issue 33): the `RolloutEngine` API over a paged KV cache.

`PagedEngine` ties the pieces together: the scheduler (`scheduler.py`: queue, admission in the page budget, GRPO
forks, rows), the block manager and page store (`blocks.py`, `pages.py`), the model runner (`runner.py`: packed
prefill, decode at bucketed fixed shapes), the decode step (`decode_step.py`) and the on-device sampler
(`sampling.py`). Sample j of prompt i is keyed by seed `sequences.mix_seed(params.seed, i * n + j)` (what
`ContinuousEngine` seeds its generator with) and counter = tokens it has so far, so a seeded sample gives the same
tokens alone or in any batch. Logprobs are today's contract: the temperature-scaled distribution before top-p
truncation (greedy: temperature 1).

The K/V live in one page store allocated at construction: the KV budget (`kv_budget`, default as
`ContinuousEngine`'s: half the memory free on the device) in pages (the scratch page included), but never more
than `max_batch` sequences of the full context can use. `make_engine` builds this engine where the runner supports
the model and a `ContinuousEngine` otherwise.

Weights are held in the serving dtype (`serving.py`): bf16 for `precision="bf16"` on CUDA (the page store too),
the model's own dtype otherwise; no autocast. A model given in another dtype is served from a copy that follows it
when `weight_version` is set (the caller may share it with a trainer); updates copy into the parameters in place.

The control surface is `ContinuousEngine`'s, shared through `engine_control.EngineControl`: `submit` / futures
(cancelling one drops it at the next step), the background thread (`start` / `stop`), `update_weights` in both
modes (copied into the model's parameter tensors between steps; the prefix cache is flushed, running sequences keep
their pages), `load_weights`, `pause` / `resume`, `wait_until`, `flush_cache` (forgets the prefix cache), `info()`
(with the page figures). Samples submitted one by one join a waiting group of the same prompt
(`Scheduler.enqueue`), so the n samples of a request share its prompt's pages. Constrained decoding
(`SamplingParams.choices`) masks each row's allowed tokens on the device (`sampler.allowed_tokens`, built on the
host) with `sampler.py`'s contract, logprobs over the renormalized distribution; a step with a constrained row
runs eagerly, after the step before it has been read (its mask needs the row's last token on the host).

Decode steps run through `decode_step.DecodeStep` (static buffers, one CUDA graph per bucket on CUDA with
`cuda_graphs`, eager on the CPU): one host-to-device copy of the step's inputs, one pinned non-blocking copy of its
results with an event (`host_copy.py`). With `overlap` (default on CUDA) step t+1 is launched before step t's
results are read, as sglang's overlap scheduler does: its input tokens are step t's samples, still on the device
(`DecodeStep.next_tokens`); positions and sampler counters are counts the host knows; a length limit is known at
once, a stop token one step late: the step after it still feeds it (its K/V land at a position inside the
sequence's admitted final length, in its own pages) and its sample is dropped. With overlap the prefix cache does
not name a sequence's completion pages (the token fed is on the device when its page is named); prompt pages are
named as before. Each token carries the weight version its step was launched with.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines import sampler
from factory.core.rollout.engines.continuous import DEFAULT_PREFILL_TOKENS, ContinuousEngine
from factory.core.rollout.engines.engine_control import EngineControl
from factory.core.rollout.engines.kv_budget import KVBudget, default_kv_budget, kv_bytes_per_token
from factory.core.rollout.engines.paged import sampling
from factory.core.rollout.engines.paged.blocks import PAGE_SIZE, BlockManager
from factory.core.rollout.engines.paged.decode_step import DecodeStep, RowInput, pack, top_columns
from factory.core.rollout.engines.paged.host_copy import Fetch, HostCopy
from factory.core.rollout.engines.paged.pages import BlockTables, PageStore
from factory.core.rollout.engines.paged.runner import PagedRunner, supports
from factory.core.rollout.engines.paged.scheduler import Group, PagedSequence, Scheduler
from factory.core.rollout.engines.paged.serving import (
    cast_parameters,
    copy_weights,
    in_dtype,
    model_dtype,
    serving_copy,
    serving_dtype,
)
from factory.core.rollout.engines.sequences import EngineStats, Sequence, check_request
from factory.infra.device import model_device

log = logging.getLogger(__name__)

# `make_engine` keywords a ContinuousEngine does not take, and the other way round
PAGED_ONLY = ("page_size", "prefix_cache", "cuda_graphs", "overlap", "owns_model")
CONTINUOUS_ONLY = ("kv_capacity",)


@dataclass
class PagedStats(EngineStats):
    graphs_captured: int = 0  # decode-step CUDA graphs captured (one per bucket met)
    capture_seconds: float = 0.0  # time spent warming up and capturing them
    overlapped: int = 0  # steps launched before the previous step's results were read


@dataclass
class _Launched:
    """A step on the device whose results the host has not read: who sampled in it (at which version, next to
    how many running sequences) and the copy of its results."""

    seqs: list[PagedSequence]
    rows: list[int]  # each sequence's row in the results
    fetch: Fetch
    top: int  # top-logprob columns in the results
    version: int
    running: int


class PagedEngine(EngineControl):
    """A `RolloutEngine` on the paged runner. Arguments as `ContinuousEngine`'s (`max_batch` running sequences,
    `max_seq_len`, `kv_budget` bytes, `max_prefill_tokens` packed prompt tokens per prefill, `precision`), plus
    `page_size` and `prefix_cache` (reuse the pages of earlier prompts' leading full pages), `cuda_graphs`
    (capture the decode step per bucket; CUDA only), `overlap` (schedule step t+1 before reading step t's
    results; default: on CUDA) and `owns_model` (the caller hands the model over: its parameters are cast to the
    serving dtype in place, no copy kept)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, weight_version: int = 0,
                 max_batch: int = 64, max_seq_len: int | None = None, name: str = "factory-policy",
                 precision: str = "fp32", kv_budget: int | None = None,
                 max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS, page_size: int = PAGE_SIZE,
                 prefix_cache: bool = True, cuda_graphs: bool = True, overlap: bool | None = None,
                 owns_model: bool = False):
        if (why := supports(model)) is not None:
            raise ValueError(f"the paged engine cannot run this model: {why}")
        if kv_budget is not None and kv_budget <= 0:
            raise ValueError(f"kv_budget must be a positive number of bytes, got {kv_budget}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        device = model_device(model)
        dtype = serving_dtype(device, precision, model_dtype(model))
        # the caller's model may be the trainer's: never cast it (unless handed over), serve a copy in the serving
        # dtype that follows it
        if owns_model:
            cast_parameters(model, dtype)
        self.source = None if in_dtype(model, dtype) else model
        self.model = (model if self.source is None else serving_copy(model, dtype)).eval()
        self.tokenizer, self.name = tokenizer, name
        self.precision = precision
        self.max_batch = max_batch
        self.max_seq_len = int(max_seq_len or model.config.max_position_embeddings)
        self.max_prefill_tokens = max(int(max_prefill_tokens), self.max_seq_len)
        self.eos_id = tokenizer.eos_token_id
        self._version = weight_version
        per_token = kv_bytes_per_token(model.config, dtype)
        budget = kv_budget if kv_budget is not None else default_kv_budget(device)
        pages_per_seq = -(-self.max_seq_len // page_size)
        # no more pages than max_batch full-context sequences can hold: the store is allocated up front
        budget = min(budget, max_batch * pages_per_seq * page_size * per_token)
        self.kv = KVBudget(budget, per_token)
        # the store holds one page more than the block manager hands out (the scratch page): inside the budget too
        blocks = BlockManager(self.kv, page_size, prefix_cache=prefix_cache, set_aside=1)
        if blocks.num_pages < 1:
            raise ValueError(f"kv_budget of {budget} bytes holds no page of {page_size} tokens ({per_token} bytes "
                             f"a token)")
        self.store = PageStore.for_model(model.config, blocks.num_pages, page_size, dtype, device)
        self.runner = PagedRunner(self.model, self.store)
        tables = BlockTables(max_batch, pages_per_seq, self.store.scratch, device)
        self.scheduler = Scheduler(blocks, tables, self.max_seq_len, self.max_prefill_tokens, prefix_cache)
        self.decode_step = DecodeStep(self.runner, tables.table, max_batch, cuda_graphs)
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self._copies = HostCopy(device)
        self._launched: _Launched | None = None  # with overlap: the step on the device whose results are unread
        self._init_control()
        self.stats = PagedStats()

    # -- public state
    @property
    def weight_version(self) -> int:
        return self._version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        # the caller changed the model's weights itself (it shares the trainer's model): a serving copy follows it
        if self.source is not None:
            copy_weights(self.model, self.source)
        self._version = version
        self.scheduler.flush_prefix_cache()  # cached K/V are the old weights'

    @property
    def device(self) -> torch.device:
        return self.store.device

    @property
    def running(self) -> int:
        return self.scheduler.live

    @property
    def queued(self) -> int:
        return self.scheduler.queued

    def info(self) -> dict:
        blocks = self.scheduler.blocks
        return {**self._control_info(), "engine": "paged", "page_size": blocks.page_size,
                "pages_total": blocks.num_pages, "pages_free": blocks.free_pages, "pages_used": blocks.used_pages,
                "pages_committed": blocks.committed, "prefix_cache_pages": len(blocks.prefix or ()),
                "kv_allocated_bytes": self.store.nbytes, "kv_budget_bytes": self.kv.total_bytes,
                "kv_token_bytes": self.kv.per_token, "max_prefill_tokens": self.max_prefill_tokens,
                **vars(self.stats)}

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most completion tokens a prompt of `prompt_len` tokens can have: within the context and, running
        alone, the pages (at least 0)."""
        blocks = self.scheduler.blocks
        return max(0, min(self.max_seq_len, blocks.num_pages * blocks.page_size) - prompt_len)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, with a message for the caller, if this request cannot run."""
        if params.n > self.max_batch:
            raise ValueError(f"n={params.n} samples do not fit the engine's max_batch of {self.max_batch} rows")
        final = min(len(prompt_ids) + params.max_new_tokens, self.max_seq_len)
        check_request(self.model.config.vocab_size, self.max_seq_len, prompt_ids, params,
                      lambda: self.scheduler.blocks.problem(len(prompt_ids), final, max(1, params.n)))

    def flush_cache(self) -> bool:
        """Forget the prefix cache if nothing is running or queued (the pages themselves stay allocated: the store
        is fixed); return whether it did."""
        with self._step_lock, self._cond:
            if self.scheduler.has_work():
                return False
            self.scheduler.flush_prefix_cache()
            return True

    # -- the control hooks (engine_control.py)
    def _request(self, prompt_ids: list[int], params: SamplingParams, seed: int, now: float) -> PagedSequence:
        return PagedSequence(prompt_ids, params, Future(), None, now, seed=seed)

    def _enqueue(self, req: Sequence) -> None:
        self.scheduler.enqueue(req)  # type: ignore[arg-type]

    def _drain_queue(self) -> list[Sequence]:
        return list(self.scheduler.drain())

    def _head_fits(self) -> bool:
        return self.scheduler.head_fits()

    def _take_admissions(self) -> list[Group]:
        return self.scheduler.admit()

    def _admitted_requests(self, admitted: list[Group]) -> list[Sequence]:
        return [s for g in admitted for s in g.samples]

    def _running_requests(self) -> list[Sequence]:
        return list(self.scheduler.running)

    def _reset(self) -> None:
        self.scheduler.reset()
        self._launched = None  # its sequences are gone; its results are never read

    def _load(self, state_dict) -> None:
        super()._load(state_dict)  # copied into the parameters in place: captured steps keep reading them
        self.scheduler.flush_prefix_cache()  # cached pages hold the old weights' K/V

    def _retire(self) -> None:
        self.stats.waited_for_kv = self.scheduler.waited_for_kv
        finished = []
        for s in self.scheduler.running:
            if s.finish_reason is not None or s.future.cancelled():
                self.scheduler.retire(s)
                if not s.future.cancelled():
                    finished.append(s)
        self._resolve(finished)

    # -- prefill and decode: launch a step, read its results (with overlap: the step before's)
    def _prefill(self, groups: list[Group]) -> None:
        sched, blocks = self.scheduler, self.scheduler.blocks
        parents = [g.samples[0] for g in groups]
        logits = self.runner.prefill([p.prompt_ids for p in parents], [blocks.block_table(p) for p in parents],
                                     [blocks.cached_tokens(p) for p in parents])
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(len(p.prompt_ids) - blocks.cached_tokens(p) for p in parents)
        copies = [c for g in groups for c in g.copies]  # the forks' partial pages, now that the parents hold them
        if copies:
            self.store.copy_pages([c[0] for c in copies], [c[1] for c in copies])
        sched.tables.sync()  # new rows' tables; decode steps carry their own new pages (`decode_step.RowInput`)
        now = time.perf_counter()
        samples = [s for g in groups for s in g.samples]
        for s in samples:
            s.admitted_at = now
        # every sample of a group draws its first token from its parent's prefill logits
        rows = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples], device=logits.device)
        ps = [s.params for s in samples]
        knobs = sampling.knobs([p.temperature for p in ps], [p.top_p for p in ps], [0] * len(ps),
                               [p.greedy for p in ps], [s.seed for s in samples], [0] * len(samples), self.device)
        k = top_columns(max(p.top_logprobs for p in ps))
        out = sampling.sample(logits.index_select(0, rows), knobs, truncate=any(p.top_p < 1 for p in ps),
                              top_logprobs=k, allowed=self._allowed(samples, logits.shape[-1]))
        self.decode_step.set_tokens(torch.tensor([s.row for s in samples], device=self.device), out.tokens)
        self._advance(self._launch(samples, list(range(len(samples))), pack(out), k))

    def _decode(self) -> None:
        ready = [s for s in self.scheduler.running if self._can_feed(s)]
        if any(s.params.choices for s in ready) and self._launched is not None:
            self._advance(None)  # a constrained row's mask needs its last token on the host: read the step first
            ready = [s for s in self.scheduler.running if self._can_feed(s)]
        self._advance(self._launch_decode(ready) if ready else None)

    def _can_feed(self, s: PagedSequence) -> bool:
        """Whether a running sequence takes a decode step: it has not finished, counting the tokens still on the
        device (with overlap a stop token is seen one step late; a length limit is known at once)."""
        n = len(s.tokens) + s.inflight
        return (s.finish_reason is None and not s.future.cancelled() and n < s.params.max_new_tokens
                and len(s.prompt_ids) + n < self.max_seq_len)

    def _launch_decode(self, ready: list[PagedSequence]) -> _Launched:
        sched, ps = self.scheduler, self.scheduler.blocks.page_size
        inputs = []
        for s in ready:
            position = sched.append(s)
            new = position % ps == 0  # its position opened a page: the step puts it into the device table
            p = s.params
            inputs.append(RowInput(s.row, position, len(s.tokens) + s.inflight, s.seed, 0, p.greedy, p.temperature,
                                   p.top_p, position // ps if new else -1,
                                   sched.blocks.block_table(s)[position // ps] if new else -1))
        # eager (the CPU): the rows up to the highest live one and the pages the longest needs; buckets otherwise
        exact = not self.decode_step.fixed_shapes
        key = self.decode_step.key(sched.bucket(exact), sched.width(exact), any(s.params.top_p < 1 for s in ready),
                                   max(s.params.top_logprobs for s in ready))
        allowed = None
        if any(s.params.choices for s in ready):  # rows of the bucket, True where a row may sample
            allowed = torch.ones(key.rows, self.model.config.vocab_size, dtype=torch.bool, device=self.device)
            allowed[[s.row for s in ready]] = self._allowed(ready, allowed.shape[1])
        packed = self.decode_step.run(key, inputs, allowed)
        self.stats.steps += 1
        self.stats.graphs_captured = self.decode_step.graphs_captured
        self.stats.capture_seconds = self.decode_step.capture_seconds
        return self._launch(ready, [s.row for s in ready], packed, key.top_logprobs)

    def _launch(self, seqs: list[PagedSequence], rows: list[int], packed: torch.Tensor, top: int) -> _Launched:
        """Start the one pinned copy of a step's results (every row: selecting rows on the device would cost a copy
        of their indices); its sequences count one token more in flight."""
        for s in seqs:
            s.inflight += 1
        return _Launched(seqs, rows, self._copies.start(packed), top, self._version, self.scheduler.live)

    def _advance(self, launched: _Launched | None) -> None:
        """With overlap, keep `launched` on the device and read the step before it; without, read it now."""
        if not self.overlap:
            if launched is not None:
                self._read(launched)
            return
        self.stats.overlapped += launched is not None and self._launched is not None
        previous, self._launched = self._launched, launched
        if previous is not None:
            self._read(previous)

    def _read(self, step: _Launched) -> None:
        """Record a step's tokens with their logprobs and check their stops (a sequence that finished in the step
        before drops its extra token); `_retire` then frees what finished."""
        k, results = step.top, step.fetch.rows()
        for s, row in zip(step.seqs, (results[r] for r in step.rows), strict=True):
            s.inflight -= 1
            if s.finish_reason is not None:
                continue
            s.tokens.append(int(row[0]))
            s.logprobs.append(row[1])
            s.versions.append(step.version)
            s.max_batch = max(s.max_batch, step.running)
            if kk := s.params.top_logprobs:
                s.top.append([(int(t), lp) for t, lp in zip(row[2:2 + kk], row[2 + k:2 + k + kk], strict=True)])
            s.check_stop(self.eos_id, self.max_seq_len, self.tokenizer)
            self.stats.generated_tokens += 1
        self.stats.max_running = max(self.stats.max_running, step.running)

    def _allowed(self, seqs: list[PagedSequence], vocab: int) -> torch.Tensor | None:
        """[rows, vocab] bool: each row's tokens that continue one of its choices (built on the host, one copy),
        or None when no row is constrained."""
        if not any(s.params.choices for s in seqs):
            return None
        return sampler.choice_mask(sampler.allowed_tokens(seqs), vocab, self.device)


ENGINES = ("auto", "paged", "continuous")


def make_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, engine: str = "auto",
                **kw: Any) -> PagedEngine | ContinuousEngine:
    """The engine `engine` names: "auto" (default) a `PagedEngine` where the paged runner supports `model`, else a
    `ContinuousEngine` (one log line says why); "paged" (a ValueError naming why if it cannot run the model) or
    "continuous". `kw` are either engine's arguments (the other engine's own ones are dropped)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    why = supports(model)
    if engine == "paged" or (engine == "auto" and why is None):
        return PagedEngine(model, tokenizer, **{k: v for k, v in kw.items() if k not in CONTINUOUS_ONLY})
    if engine == "auto":
        log.info("rollout engine: ContinuousEngine, not the paged engine: %s", why)
    return ContinuousEngine(model, tokenizer, **{k: v for k, v in kw.items() if k not in PAGED_ONLY})
