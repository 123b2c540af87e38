"""The paged rollout engine (issue 33, first version): the `RolloutEngine` API over a paged KV cache.

`PagedEngine` ties the pieces together: the scheduler (`scheduler.py`: queue, admission in the page budget, GRPO
forks, rows), the block manager and page store (`blocks.py`, `pages.py`), the model runner (`runner.py`: packed
prefill, decode at bucketed fixed shapes) and the on-device sampler (`sampling.py`). Sample j of prompt i is keyed
by seed `sequences.mix_seed(params.seed, i * n + j)` (what `ContinuousEngine` seeds its generator with) and counter
= tokens it has so far, so a seeded sample gives the same tokens alone or in any batch. Logprobs are today's
contract: the temperature-scaled distribution before top-p truncation (greedy: temperature 1).

The K/V live in one page store allocated at construction: the KV budget (`kv_budget`, default as
`ContinuousEngine`'s: half the memory free on the device) in pages, but never more than `max_batch` sequences of
the full context can use. `make_engine` builds this engine where the runner supports the model and a
`ContinuousEngine` otherwise.

Weights are held in the serving dtype (`serving.py`): bf16 for `precision="bf16"` on CUDA (the page store too),
the model's own dtype otherwise; no autocast. A model given in another dtype is served from a copy that follows it
when `weight_version` is set (the caller may share it with a trainer); updates copy into the parameters in place.

Decode steps run through `decode_step.DecodeStep` (static buffers, one CUDA graph per bucket on CUDA with
`cuda_graphs`, eager on the CPU): one host-to-device copy of the step's inputs, one pinned non-blocking copy of its
results with an event (`host_copy.py`). With `overlap` (default on CUDA) step t+1 is launched before step t's
results are read, as sglang's overlap scheduler does: its input tokens are step t's samples, still on the device
(`DecodeStep.next_tokens`); positions and sampler counters are counts the host knows; a length limit is known at
once, a stop token one step late: the step after it still feeds it (its K/V land at a position inside the
sequence's admitted final length, in its own pages) and its sample is dropped. With overlap the prefix cache does
not name a sequence's completion pages (the token fed is on the device when its page is named); prompt pages are
named as before.

What `ContinuousEngine` has and this version does not (yet): the background thread and `submit` / futures (the
HTTP server's path), `update_weights` with "in_flight" mode and `pause`, and constrained decoding
(`SamplingParams.choices`, refused by `check`). `load_weights` applies between `generate` calls.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.core.rollout.base import Completion, SamplingParams
from factory.core.rollout.continuous import DEFAULT_PREFILL_TOKENS, ContinuousEngine
from factory.core.rollout.kv_budget import KVBudget, default_kv_budget, kv_bytes_per_token
from factory.core.rollout.paged import sampling
from factory.core.rollout.paged.blocks import PAGE_SIZE, BlockManager
from factory.core.rollout.paged.decode_step import DecodeStep, RowInput, pack, top_columns
from factory.core.rollout.paged.host_copy import Fetch, HostCopy
from factory.core.rollout.paged.pages import BlockTables, PageStore
from factory.core.rollout.paged.runner import PagedRunner, supports
from factory.core.rollout.paged.scheduler import Group, PagedSequence, Scheduler
from factory.core.rollout.paged.serving import copy_weights, in_dtype, model_dtype, serving_copy, serving_dtype
from factory.core.rollout.sequences import EngineStats, check_request, load_state_dict_into, mix_seed
from factory.infra.device import model_device

log = logging.getLogger(__name__)

# `make_engine` keywords a ContinuousEngine does not take
PAGED_ONLY = ("page_size", "prefix_cache", "cuda_graphs", "overlap")


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


class PagedEngine:
    """A `RolloutEngine` on the paged runner. Arguments as `ContinuousEngine`'s (`max_batch` running sequences,
    `max_seq_len`, `kv_budget` bytes, `max_prefill_tokens` packed prompt tokens per prefill, `precision`), plus
    `page_size` and `prefix_cache` (reuse the pages of earlier prompts' leading full pages), `cuda_graphs`
    (capture the decode step per bucket; CUDA only) and `overlap` (schedule step t+1 before reading step t's
    results; default: on CUDA)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, weight_version: int = 0,
                 max_batch: int = 64, max_seq_len: int | None = None, name: str = "factory-policy",
                 precision: str = "fp32", kv_budget: int | None = None,
                 max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS, page_size: int = PAGE_SIZE,
                 prefix_cache: bool = True, cuda_graphs: bool = True, overlap: bool | None = None):
        if (why := supports(model)) is not None:
            raise ValueError(f"the paged engine cannot run this model: {why}")
        if kv_budget is not None and kv_budget <= 0:
            raise ValueError(f"kv_budget must be a positive number of bytes, got {kv_budget}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        device = model_device(model)
        dtype = serving_dtype(device, precision, model_dtype(model))
        # the caller's model may be the trainer's: never cast it, serve a copy in the serving dtype that follows it
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
        blocks = BlockManager(KVBudget(budget, per_token), page_size, prefix_cache=prefix_cache)
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
        self._launched: _Launched | None = None
        self._seeds = random.Random()
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
        self._new_weights(version)

    def _new_weights(self, version: int) -> None:
        self._version = version
        self.scheduler.flush_prefix_cache()  # cached K/V are the old weights'

    @property
    def device(self) -> torch.device:
        return self.store.device

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p).input_ids for p in prompts]

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, with a message for the caller, if this request cannot run."""
        if params.choices:
            raise ValueError("choices (constrained decoding) are not supported by the paged engine yet")
        if params.n > self.max_batch:
            raise ValueError(f"n={params.n} samples do not fit the engine's max_batch of {self.max_batch} rows")
        final = min(len(prompt_ids) + params.max_new_tokens, self.max_seq_len)
        check_request(self.model.config.vocab_size, self.max_seq_len, prompt_ids, params,
                      lambda: self.scheduler.blocks.problem(len(prompt_ids), final, max(1, params.n)))

    # -- the RolloutEngine calls
    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[Completion]]:
        """For each prompt, `params.n` completions; sample j of prompt i draws from seed (params.seed, i * n + j).
        `params` may also be one `SamplingParams` per prompt (their own lengths, say), all run together."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(each) != len(prompts):
            raise ValueError(f"params: expected one SamplingParams or one per prompt ({len(prompts)}), got "
                             f"{len(each)}")
        for p, ps in zip(prompts, each, strict=True):
            self.check(p, ps)
        drawn = self._seeds.getrandbits(63)  # for requests without a seed
        now = time.perf_counter()
        groups = [Group([PagedSequence(list(p), ps, Future(), None, now,
                                       seed=mix_seed(drawn if ps.seed is None else ps.seed, i * ps.n + j))
                         for j in range(ps.n)]) for i, (p, ps) in enumerate(zip(prompts, each, strict=True))]
        for g in groups:
            self.scheduler.add(g)
        while self.scheduler.has_work() or self._launched is not None:
            self.step()
        return [[s.completion(self.tokenizer) for s in g.samples] for g in groups]

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Replace the policy weights (between `generate` calls: nothing is running then), copied into the served
        parameters in place (converted to their dtype); later completions carry `version`."""
        if self.scheduler.has_work() or self._launched is not None:
            raise RuntimeError("load_weights while sequences run: the paged engine applies updates between calls")
        load_state_dict_into(self.model, state_dict)
        self._new_weights(int(version))

    # -- one scheduler step
    def step(self) -> None:
        """Admit and prefill what fits, else run one decode step; read the results of the step before it (with
        `overlap`) or of this one, and retire what finished."""
        admitted = self.scheduler.admit()
        launched = None
        if admitted:
            launched = self._prefill(admitted)
        elif ready := [s for s in self.scheduler.running if self._can_feed(s)]:
            launched = self._decode(ready)
        elif self._launched is None:
            raise RuntimeError("the paged engine cannot make progress: nothing runs and the head request does not "
                               "fit (check() should have refused it)")
        if self.overlap:
            self.stats.overlapped += launched is not None and self._launched is not None
            previous, self._launched = self._launched, launched
            if previous is not None:
                self._read(previous)
        elif launched is not None:
            self._read(launched)

    def _can_feed(self, s: PagedSequence) -> bool:
        """Whether a running sequence takes a decode step: it has not finished, counting the tokens still on the
        device (with overlap a stop token is seen one step late; a length limit is known at once)."""
        n = len(s.tokens) + s.inflight
        return (s.finish_reason is None and n < s.params.max_new_tokens
                and len(s.prompt_ids) + n < self.max_seq_len)

    def _prefill(self, groups: list[Group]) -> _Launched:
        sched, blocks = self.scheduler, self.scheduler.blocks
        parents = [g.samples[0] for g in groups]
        logits = self.runner.prefill([p.prompt_ids for p in parents], [blocks.block_table(p) for p in parents],
                                     [blocks.cached_tokens(p) for p in parents])
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(len(p.prompt_ids) - blocks.cached_tokens(p) for p in parents)
        copies = [c for g in groups for c in g.copies]
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
                              top_logprobs=k)
        self.decode_step.set_tokens(torch.tensor([s.row for s in samples], device=self.device), out.tokens)
        return self._launch(samples, list(range(len(samples))), pack(out), k)

    def _decode(self, ready: list[PagedSequence]) -> _Launched:
        sched, ps = self.scheduler, self.scheduler.blocks.page_size
        inputs = []
        for s in ready:
            position = sched.append(s)
            new = position % ps == 0  # its position opened a page: the step puts it into the device table
            p = s.params
            inputs.append(RowInput(s.row, position, len(s.tokens) + s.inflight, s.seed, 0, p.greedy, p.temperature,
                                   p.top_p, position // ps if new else -1,
                                   sched.blocks.block_table(s)[position // ps] if new else -1))
        key = self.decode_step.key(sched.bucket(), sched.width(), any(s.params.top_p < 1 for s in ready),
                                   max(s.params.top_logprobs for s in ready))
        packed = self.decode_step.run(key, inputs)
        self.stats.steps += 1
        self.stats.graphs_captured = self.decode_step.graphs_captured
        self.stats.capture_seconds = self.decode_step.capture_seconds
        return self._launch(ready, [s.row for s in ready], packed, key.top_logprobs)

    def _launch(self, seqs: list[PagedSequence], rows: list[int], packed: torch.Tensor, top: int) -> _Launched:
        """Start the one pinned copy of a step's results (every row: selecting rows on the device would cost a copy
        of their indices); its sequences count one token more in flight."""
        for s in seqs:
            s.inflight += 1
        return _Launched(seqs, rows, self._copies.start(packed), top, self._version, len(self.scheduler.running))

    def _read(self, step: _Launched) -> None:
        """Record a step's tokens with their logprobs, check their stops (a sequence that finished in the step before
        drops its extra token), and retire what finished."""
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
        self.stats.waited_for_kv = self.scheduler.waited_for_kv
        for s in self.scheduler.running:
            if s.finish_reason is not None:
                self.scheduler.retire(s)
                self.stats.completed += 1


def make_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                **kw: Any) -> PagedEngine | ContinuousEngine:
    """A `PagedEngine` where the paged runner supports `model`, else a `ContinuousEngine` (one log line says why);
    `kw` are either engine's arguments (the paged-only ones are dropped for the fallback)."""
    if (why := supports(model)) is None:
        return PagedEngine(model, tokenizer, **kw)
    log.info("rollout engine: ContinuousEngine, not the paged engine: %s", why)
    return ContinuousEngine(model, tokenizer, **{k: v for k, v in kw.items() if k not in PAGED_ONLY})
