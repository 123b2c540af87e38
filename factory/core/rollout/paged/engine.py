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
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.core.rollout.base import Completion, SamplingParams
from factory.core.rollout.continuous import DEFAULT_PREFILL_TOKENS, ContinuousEngine
from factory.core.rollout.kv_budget import KVBudget, default_kv_budget, kv_bytes_per_token
from factory.core.rollout.paged import sampling
from factory.core.rollout.paged.blocks import PAGE_SIZE, BlockManager
from factory.core.rollout.paged.pages import BlockTables, PageStore
from factory.core.rollout.paged.runner import PagedRunner, supports
from factory.core.rollout.paged.scheduler import Group, PagedSequence, Scheduler
from factory.core.rollout.paged.serving import copy_weights, in_dtype, model_dtype, serving_copy, serving_dtype
from factory.core.rollout.sequences import EngineStats, check_request, load_state_dict_into, mix_seed
from factory.infra.device import model_device

log = logging.getLogger(__name__)

PAGED_ONLY = ("page_size", "prefix_cache")  # `make_engine` keywords a ContinuousEngine does not take


class PagedEngine:
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
        self._seeds = random.Random()
        self.stats = EngineStats()

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
        while self.scheduler.has_work():
            self.step()
        return [[s.completion(self.tokenizer) for s in g.samples] for g in groups]

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Replace the policy weights (between `generate` calls: nothing is running then), copied into the served
        parameters in place (converted to their dtype); later completions carry `version`."""
        if self.scheduler.has_work():
            raise RuntimeError("load_weights while sequences run: the paged engine applies updates between calls")
        load_state_dict_into(self.model, state_dict)
        self._new_weights(int(version))

    # -- one scheduler step
    def step(self) -> None:
        """Admit and prefill what fits, else run one decode step; retire what finished."""
        admitted = self.scheduler.admit()
        if admitted:
            self._prefill(admitted)
        elif self.scheduler.running:
            self._decode()
        else:
            raise RuntimeError("the paged engine cannot make progress: nothing runs and the head request does not "
                               "fit (check() should have refused it)")
        for s in self.scheduler.running:
            if s.finish_reason is not None:
                self.scheduler.retire(s)
                self.stats.completed += 1

    def _prefill(self, groups: list[Group]) -> None:
        sched, blocks = self.scheduler, self.scheduler.blocks
        parents = [g.samples[0] for g in groups]
        logits = self.runner.prefill([p.prompt_ids for p in parents], [blocks.block_table(p) for p in parents],
                                     [blocks.cached_tokens(p) for p in parents])
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(len(p.prompt_ids) - blocks.cached_tokens(p) for p in parents)
        copies = [c for g in groups for c in sched.fork(g)]
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
        out = sampling.sample(logits, knobs, truncate=any(p.top_p < 1 for p in ps), top_logprobs=k)
        host = torch.cat([out.tokens[:, None].double(), out.logprobs[:, None].double(), out.top_ids.double(),
                          out.top_logprobs.double()], dim=1).tolist()
        b = len(self.scheduler.running)
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
        self.stats.waited_for_kv = self.scheduler.waited_for_kv


def make_engine(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                **kw: Any) -> PagedEngine | ContinuousEngine:
    """A `PagedEngine` where the paged runner supports `model`, else a `ContinuousEngine` (one log line says why);
    `kw` are either engine's arguments (the paged-only ones are dropped for the fallback)."""
    if (why := supports(model)) is None:
        return PagedEngine(model, tokenizer, **kw)
    log.info("rollout engine: ContinuousEngine, not the paged engine: %s", why)
    return ContinuousEngine(model, tokenizer, **{k: v for k, v in kw.items() if k not in PAGED_ONLY})
