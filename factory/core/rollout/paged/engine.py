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

The control surface is `ContinuousEngine`'s, shared through `engine_control.EngineControl`: `submit` / futures
(cancelling one drops it at the next step), the background thread (`start` / `stop`), `update_weights` in both
modes (copied into the model's parameter tensors between steps; the prefix cache is flushed, running sequences keep
their pages), `load_weights`, `pause` / `resume`, `wait_until`, `flush_cache` (forgets the prefix cache), `info()`
(with the page figures). Samples submitted one by one join a waiting group of the same prompt
(`Scheduler.enqueue`), so the n samples of a request share its prompt's pages. Constrained decoding
(`SamplingParams.choices`) masks each row's allowed tokens on the device (`sampler.allowed_tokens`, built on the
host) with `sampler.py`'s contract, logprobs over the renormalized distribution.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.core.rollout import sampler
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.continuous import DEFAULT_PREFILL_TOKENS, ContinuousEngine
from factory.core.rollout.embedded import decode_autocast
from factory.core.rollout.engine_control import EngineControl
from factory.core.rollout.kv_budget import KVBudget, default_kv_budget, kv_bytes_per_token
from factory.core.rollout.paged import sampling
from factory.core.rollout.paged.blocks import PAGE_SIZE, BlockManager
from factory.core.rollout.paged.pages import BlockTables, PageStore
from factory.core.rollout.paged.runner import PagedRunner, supports
from factory.core.rollout.paged.scheduler import Group, PagedSequence, Scheduler
from factory.core.rollout.sequences import Sequence, check_request
from factory.infra.device import model_device

log = logging.getLogger(__name__)

PAGED_ONLY = ("page_size", "prefix_cache")  # `make_engine` keywords a ContinuousEngine does not take
CONTINUOUS_ONLY = ("kv_capacity",)  # and the other way round


class PagedEngine(EngineControl):
    """A `RolloutEngine` on the paged runner. Arguments as `ContinuousEngine`'s (`max_batch` running sequences,
    `max_seq_len`, `kv_budget` bytes, `max_prefill_tokens` packed prompt tokens per prefill, `precision`), plus
    `page_size` and `prefix_cache` (reuse the pages of earlier prompts' leading full pages)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, weight_version: int = 0,
                 max_batch: int = 64, max_seq_len: int | None = None, name: str = "factory-policy",
                 precision: str = "fp32", kv_budget: int | None = None,
                 max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS, page_size: int = PAGE_SIZE,
                 prefix_cache: bool = True):
        if (why := supports(model)) is not None:
            raise ValueError(f"the paged engine cannot run this model: {why}")
        if kv_budget is not None and kv_budget <= 0:
            raise ValueError(f"kv_budget must be a positive number of bytes, got {kv_budget}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model, self.tokenizer, self.name = model.eval(), tokenizer, name
        self.precision = precision
        self.max_batch = max_batch
        self.max_seq_len = int(max_seq_len or model.config.max_position_embeddings)
        self.max_prefill_tokens = max(int(max_prefill_tokens), self.max_seq_len)
        self.eos_id = tokenizer.eos_token_id
        self._version = weight_version
        device = model_device(model)
        dtype = torch.bfloat16 if precision == "bf16" and device.type == "cuda" else model.dtype
        per_token = kv_bytes_per_token(model.config, dtype)
        budget = kv_budget if kv_budget is not None else default_kv_budget(device)
        pages_per_seq = -(-self.max_seq_len // page_size)
        # no more pages than max_batch full-context sequences can hold: the store is allocated up front
        budget = min(budget, max_batch * pages_per_seq * page_size * per_token)
        self.kv = KVBudget(budget, per_token)
        # the store holds one page more than the block manager hands out (the scratch page): inside the budget too
        blocks = BlockManager(KVBudget(budget - page_size * per_token, per_token), page_size,
                              prefix_cache=prefix_cache)
        if blocks.num_pages < 1:
            raise ValueError(f"kv_budget of {budget} bytes holds no page of {page_size} tokens ({per_token} bytes "
                             f"a token)")
        self.store = PageStore.for_model(model.config, blocks.num_pages, page_size, dtype, device)
        self.runner = PagedRunner(model, self.store)
        tables = BlockTables(max_batch, pages_per_seq, self.store.scratch, device)
        self.scheduler = Scheduler(blocks, tables, self.max_seq_len, self.max_prefill_tokens, prefix_cache)
        self._init_control()

    # -- public state
    @property
    def weight_version(self) -> int:
        return self._version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        # the caller changed the model's weights itself (it shares the trainer's model): cached K/V are stale
        self._version = version
        self.scheduler.flush_prefix_cache()

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

    def _load(self, state_dict) -> None:
        super()._load(state_dict)  # copied into the parameters in place: captured steps keep reading them
        self.scheduler.flush_prefix_cache()  # cached pages hold the old weights' K/V

    def _retire(self) -> None:
        finished = []
        for s in self.scheduler.running:
            if s.finish_reason is not None or s.future.cancelled():
                self.scheduler.retire(s)
                if not s.future.cancelled():
                    finished.append(s)
        self._resolve(finished)
        self.stats.waited_for_kv = self.scheduler.waited_for_kv

    def _prefill(self, groups: list[Group]) -> None:
        blocks = self.scheduler.blocks
        parents = [g.samples[0] for g in groups]
        with decode_autocast(self.device, self.precision):
            logits = self.runner.prefill([p.prompt_ids for p in parents], [blocks.block_table(p) for p in parents],
                                         [blocks.cached_tokens(p) for p in parents])
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(len(p.prompt_ids) - blocks.cached_tokens(p) for p in parents)
        copies = [c for g in groups for c in g.copies]  # the forks' partial pages, now that the parents hold them
        if copies:
            self.store.copy_pages([c[0] for c in copies], [c[1] for c in copies])
        now = time.perf_counter()
        samples = [s for g in groups for s in g.samples]
        for s in samples:
            s.admitted_at = now
        # every sample of a group draws its first token from its parent's prefill logits
        rows = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples], device=logits.device)
        self._sample(logits.index_select(0, rows), samples)

    def _decode(self) -> None:
        sched = self.scheduler
        b = sched.bucket()
        live = [s for s in sched.rows[:b] if s is not None]
        tokens, positions = [0] * b, [0] * b
        for s in live:
            tokens[s.row], positions[s.row] = s.tokens[-1], sched.append(s)
        step = torch.tensor([tokens, positions], dtype=torch.int64).to(self.device)
        table = sched.tables.sync()[:b, : sched.width()]
        with decode_autocast(self.device, self.precision):
            logits = self.runner.decode(step[0], step[1], table)
        self.stats.steps += 1
        self._sample(logits.index_select(0, torch.tensor([s.row for s in live], device=logits.device)), live)

    def _sample(self, logits: torch.Tensor, seqs: list[PagedSequence]) -> None:
        """Sample each sequence's next token on the device, record it with its logprob (one copy to the host), and
        check its stops."""
        ps = [s.params for s in seqs]
        knobs = sampling.knobs([p.temperature for p in ps], [p.top_p for p in ps], [0] * len(ps),
                               [p.greedy for p in ps], [s.seed for s in seqs], [len(s.tokens) for s in seqs],
                               self.device)
        k = max(p.top_logprobs for p in ps)
        out = sampling.sample(logits, knobs, truncate=any(p.top_p < 1 for p in ps), top_logprobs=k,
                              allowed=self._allowed(seqs, logits.shape[-1]))
        host = torch.cat([out.tokens[:, None].double(), out.logprobs[:, None].double(), out.top_ids.double(),
                          out.top_logprobs.double()], dim=1).tolist()
        b = self.scheduler.live
        for s, row in zip(seqs, host, strict=True):
            s.tokens.append(int(row[0]))
            s.logprobs.append(row[1])
            s.versions.append(self._version)
            s.max_batch = max(s.max_batch, b)
            if kk := s.params.top_logprobs:
                s.top.append([(int(t), lp) for t, lp in zip(row[2:2 + kk], row[2 + k:2 + k + kk], strict=True)])
            s.check_stop(self.eos_id, self.max_seq_len, self.tokenizer)
        self.stats.generated_tokens += len(seqs)
        self.stats.max_running = max(self.stats.max_running, b)

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
