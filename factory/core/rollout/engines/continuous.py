"""The continuous-batching rollout engine: a slot-based KV cache that requests join and leave between decode steps.

Owns the scheduler (admission, one decode step for every running sequence, retirement), the per-request
sampler state, and weight updates applied between decode steps. The HTTP server (`server.py`) and in-process
callers (`generate`) submit requests to it; a background thread (`start`) or the caller (`step`) drives it.

KV cache (`SlotKVCache`, slot_cache.py): running sequences are dense rows of per-layer buffers, all writing one
shared column per decode step; a sequence's columns are right-aligned and an explicit mask hides the columns left
of its start. Positions are per row, so where a sequence sits in the buffer does not change its numbers. A decode
step costs one forward over the n running rows plus an in-place column write per layer.

Any decoder-only transformers causal LM whose layers are all attention runs (Llama, Qwen2/3, Mistral, Gemma 1-3,
Phi, GPT-2, ...): the engine hands the model a 4-D mask (boolean for sdpa, additive for eager), which every
architecture's mask builder passes through unchanged, and the cache as `cache=` (`past_key_values=` before
transformers 5.2x: models/compat.py). Sliding-window layers are exact because sequences are capped at the window
(`factory.architectures.attention_window`); recurrent or hybrid models are refused (`architecture_problem`).

New requests are prefilled together in one left-padded forward (identical prompts — the n samples of a GRPO
group — once; at most `max_prefill_tokens` padded prompt tokens per forward, which bounds its activations), then
copied into free rows; their first token is sampled from the prefill logits.

Memory (`kv_budget.py`): the KV cache lives inside a budget in bytes (`kv_budget`; default: half the memory free
when the engine is built). A request joins when, with it, every running sequence can grow to its final length
(prompt + max_new_tokens) inside the budget, together with its prefill's K/V; until then it waits, in arrival order.
One that could not fit even alone is refused by `check`, naming the setting.

Sampling is per request (`sampler.py`): each has its own `torch.Generator`, so a seeded request gives the same
tokens whatever else shares the batch. Logprobs are those of the temperature-scaled distribution before top-p
truncation — what `factory.core.trainer.torch_trainer.token_logprobs` computes at that temperature (greedy:
temperature 1). `SamplingParams.choices` constrains a completion to one of a few token sequences.

Weight updates (`update_weights`) are applied between decode steps. mode="in_flight": applied at once; running
sequences keep their KV (computed by the old weights, as PipelineRL does) and their later tokens carry the new
version. mode="finish_old": admissions stop, running sequences finish on the old weights, then the swap happens and
queued requests start on the new ones. Every completion lists the version of each token (`token_versions`).

Device: the engine computes where its model is (looked up at each step, so it follows the model it is given):
prompts, positions, masks, the KV cache and each request's generator are made there. A decode step makes one
host-to-device copy (the rows' last tokens, positions and start columns, packed) and one device-to-host copy (the
sampled tokens with their logprobs and top alternatives, packed), which is the step's only wait on the device;
the scheduler's bookkeeping stays in Python. On a GPU, `precision="bf16"` runs the model under bf16 autocast over
its fp32 weights; on the CPU it is always fp32, so CPU tokens do not depend on it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.architectures import architecture_problem, attention_window
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines import sampler
from factory.core.rollout.engines.embedded import decode_autocast
from factory.core.rollout.engines.engine_control import PAUSE_MODES, UPDATE_MODES, EngineControl, PauseMode, UpdateMode
from factory.core.rollout.engines.kv_budget import KVBudget, default_kv_budget, kv_bytes_per_token, mib
from factory.core.rollout.engines.sequences import EngineStats, Sequence, check_request, load_state_dict_into
from factory.core.rollout.engines.slot_cache import SlotKVCache
from factory.infra.device import model_device
from factory.models.compat import cache_kwargs

log = logging.getLogger(__name__)

DEFAULT_PREFILL_TOKENS = 8192  # padded prompt tokens in one prefill forward (at least one whole prompt)
__all__ = ["PAUSE_MODES", "UPDATE_MODES", "ContinuousEngine", "EngineStats", "PauseMode", "SlotKVCache", "UpdateMode",
           "load_state_dict_into"]


class ContinuousEngine(EngineControl):
    """Continuous-batching sampler over a transformers causal LM (a `RolloutEngine`).

    `max_batch` rows decode together; waiting requests join whenever rows are free and the KV budget has room.
    `max_seq_len` (default: the model's `max_position_embeddings`; never past its sliding window) bounds prompt +
    completion; `kv_capacity` is the KV buffer's initial width in columns (it doubles when needed); `kv_budget`
    bounds the KV cache in bytes (default: from the machine, `kv_budget.default_kv_budget`); `max_prefill_tokens`
    bounds one prefill forward (padded prompt tokens; never below `max_seq_len`). Drive it with `start()` (a
    background thread) or, single-threaded, through `generate` / `step`.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, weight_version: int = 0,
                 max_batch: int = 64, max_seq_len: int | None = None, name: str = "factory-policy",
                 kv_capacity: int = 64, precision: str = "fp32", kv_budget: int | None = None,
                 max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS):
        problem = architecture_problem(model.config)
        if problem is not None:
            raise ValueError(problem)
        attn = model.config._attn_implementation
        if attn not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {attn!r} is not supported (use 'sdpa' or 'eager')")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.max_batch = max_batch
        self.precision = precision  # "bf16": autocast on a GPU (see the module docstring)
        self.max_seq_len = int(max_seq_len or model.config.max_position_embeddings)
        window = attention_window(model.config)
        if window is not None:  # past the window the full mask would show columns the sliding layers hide
            self.max_seq_len = min(self.max_seq_len, window)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self._version = weight_version
        self._additive_mask = attn == "eager"  # eager attention adds its mask; sdpa takes booleans
        self._kv_capacity = kv_capacity  # initial KV columns; the cache doubles as needed
        self._cache = self._new_cache()
        device = self.device
        kv_dtype = torch.bfloat16 if precision == "bf16" and device.type == "cuda" else model.dtype
        if kv_budget is not None and kv_budget <= 0:
            raise ValueError(f"kv_budget must be a positive number of bytes, got {kv_budget}")
        self.kv = KVBudget(kv_budget if kv_budget is not None else default_kv_budget(device),
                           kv_bytes_per_token(model.config, kv_dtype))
        self._kv_measured = False  # per_token is the config's estimate until the first prefill's K/V are seen
        self.max_prefill_tokens = max(int(max_prefill_tokens), self.max_seq_len)
        if self.kv.problem(self.max_seq_len - 1, self.max_seq_len) is not None:
            log.warning("the KV cache budget (%s) cannot hold one request of the full context (%d tokens, about %s "
                        "with its prefill): the longest requests will be refused", mib(self.kv.total_bytes),
                        self.max_seq_len, mib(2 * self.max_seq_len * self.kv.per_token))
        self._rows: list[Sequence] = []  # row i of the cache runs self._rows[i]
        self._queue: deque[Sequence] = deque()
        self._init_control()

    def _new_cache(self) -> SlotKVCache:
        # No row ever needs more columns than the context and the write column.
        return SlotKVCache(self.max_batch, self._kv_capacity, max_columns=self.max_seq_len + 1)

    # ------------------------------------------------------------------ public state
    @property
    def device(self) -> torch.device:
        """Where the engine computes: its model's device."""
        return model_device(self.model)

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def info(self) -> dict:
        return {**self._control_info(), "engine": "continuous", "kv_width": self._cache.width,
                "kv_capacity": self._cache.capacity, "kv_rows": self._cache.rows,
                "kv_allocated_bytes": self._cache.allocated_bytes, "kv_budget_bytes": self.kv.total_bytes,
                "kv_token_bytes": self.kv.per_token, "max_prefill_tokens": self.max_prefill_tokens,
                **vars(self.stats)}

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most completion tokens a prompt of `prompt_len` tokens can have: within the context and, running
        alone, the KV budget (at least 0)."""
        alone = self.kv.columns - prompt_len - 1  # its row's final columns + its prefill (KVBudget.problem)
        return max(0, min(self.max_seq_len, alone) - prompt_len)

    # ------------------------------------------------------------------ requests
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, with a message for the caller, if this request cannot run."""
        final = min(len(prompt_ids) + params.max_new_tokens, self.max_seq_len)
        check_request(self.model.config.vocab_size, self.max_seq_len, prompt_ids, params,
                      lambda: self.kv.problem(len(prompt_ids), final))

    # ------------------------------------------------------------------ the control hooks (engine_control.py)
    def _request(self, prompt_ids: list[int], params: SamplingParams, seed: int, now: float) -> Sequence:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return Sequence(prompt_ids, params, Future(), gen, now)

    def _enqueue(self, req: Sequence) -> None:
        self._queue.append(req)

    def _drain_queue(self) -> list[Sequence]:
        queued, self._queue = list(self._queue), deque()
        return queued

    def _running_requests(self) -> list[Sequence]:
        return list(self._rows)

    def _reset(self) -> None:
        self._rows = []
        self._cache = self._new_cache()

    def flush_cache(self) -> bool:
        """Free the KV buffers if nothing is running or queued; return whether it did."""
        with self._step_lock, self._cond:
            if self._rows or self._queue:
                return False
            self._cache.release()
            return True

    # -- admission: free rows, the KV budget, the prefill's size
    def _plan_columns(self) -> int:
        """KV columns the running rows may grow to (their longest final length, and the write column)."""
        return max((r.final_length(self.max_seq_len) for r in self._rows), default=0) + 1

    def _head_fits(self) -> bool:
        """Whether the first live queued request could join now (caller holds _cond)."""
        if len(self._rows) >= self.max_batch:
            return False
        head = next((r for r in self._queue if not r.future.cancelled()), None)
        if head is None:
            return False
        cols = max(self._plan_columns(), head.final_length(self.max_seq_len) + 1)
        return self.kv.fits(len(self._rows) + 1, cols, len(head.prompt_ids))

    def _take_admissions(self) -> list[Sequence]:
        """Pop the queued requests that join now, in arrival order: while rows are free, the running and admitted
        sequences at their final lengths fit the KV budget with the prefill's K/V, and the prefill stays within
        `max_prefill_tokens`. The first that does not fit waits, and so does everything behind it (no request
        overtakes a long one forever). Caller holds _cond."""
        admit: list[Sequence] = []
        cols, unique, longest = self._plan_columns(), set(), 0
        while self._queue and len(self._rows) + len(admit) < self.max_batch:
            req = self._queue[0]
            if req.future.cancelled():
                self._queue.popleft()
                continue
            key = tuple(req.prompt_ids)
            u, p = len(unique | {key}), max(longest, len(key))
            c = max(cols, req.final_length(self.max_seq_len) + 1)
            if admit and u * p > self.max_prefill_tokens:
                break
            if not self.kv.fits(len(self._rows) + len(admit) + 1, c, u * p):
                if not admit:
                    self.stats.waited_for_kv += 1
                break
            self._queue.popleft()
            admit.append(req)
            unique.add(key)
            cols, longest = c, p
        return admit

    def _mask(self, allowed: Tensor) -> Tensor:
        if not self._additive_mask:
            return allowed
        dtype = self.model.dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                          torch.finfo(dtype).min)

    def _prefill(self, admit: list[Sequence]) -> None:
        """Run the new prompts (each distinct prompt once), add their rows, sample their first token."""
        unique: dict[tuple[int, ...], int] = {}
        src = [unique.setdefault(tuple(r.prompt_ids), len(unique)) for r in admit]
        prompts = list(unique)
        p = max(len(q) for q in prompts)
        device = self.device
        # Left-padded on the host, then one copy to the device: each row's tokens followed by its first real column.
        packed = torch.tensor([[self.pad_id] * (p - len(q)) + list(q) + [p - len(q)] for q in prompts],
                              dtype=torch.long, device=device)
        ids, offset = packed[:, :p], packed[:, p:]
        cols = torch.arange(p, device=device)
        pos = (cols[None, :] - offset).clamp(min=0)
        valid = cols[None, :] >= offset  # [u, p] real (non-pad) columns
        allowed = torch.tril(torch.ones(p, p, dtype=torch.bool, device=device))[None] & valid[:, None, :]
        # Pad queries attend to themselves: a row with nothing to attend to would turn into NaN.
        allowed = allowed | torch.eye(p, dtype=torch.bool, device=device)[None]
        # Copied before the forward is queued, so that the copies do not wait for it.
        src_t = torch.tensor(src, device=device)
        knobs = sampler.knobs(admit, device)
        room = self.kv.columns - len(prompts) * p  # what the cache may hold while the prefill's K/V exist
        self._cache.fit(room)
        self._cache.begin_prefill()
        try:
            with decode_autocast(device, self.precision):
                out = self.model(input_ids=ids, position_ids=pos,
                                 attention_mask=self._mask(allowed[:, None]),
                                 use_cache=True, logits_to_keep=1, **cache_kwargs(self.model, self._cache))
        finally:
            kv = self._cache.end_prefill()
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(len(q) for q in prompts)
        if not self._kv_measured:
            self._measure_kv(kv)
            room = self.kv.columns - len(prompts) * p
        self._cache.insert(kv, src_t, [len(r.prompt_ids) for r in admit], allow=room)
        now = time.perf_counter()
        for r in admit:
            r.admitted_at = now
        self._rows.extend(admit)
        first = len(self._rows) - len(admit)
        self._sample(out.logits[:, -1, :].index_select(0, src_t), self._rows[first:], knobs)

    def _measure_kv(self, kv: list[tuple[Tensor, Tensor]]) -> None:
        """Replace the config's estimate of a token's K/V bytes by what the model produced."""
        real = sum(t.shape[1] * t.shape[3] * t.element_size() for pair in kv for t in pair)
        if real != self.kv.per_token:
            log.warning("a cached token takes %d bytes of K/V, not the %d the model config gives; the KV budget "
                        "now counts %d", real, self.kv.per_token, real)
            self.kv.per_token = real
        self._kv_measured = True

    def _decode(self) -> None:
        cache = self._cache
        cache.reserve_decode(self.kv.columns)
        rows = self._rows
        device = self.device
        # The step's host-to-device copies, both made before the forward is queued (so neither waits for it): the
        # last tokens, their positions and the rows' first valid columns; the rows' sampling knobs.
        step = torch.tensor([[r.tokens[-1] for r in rows], [r.next_position for r in rows], cache.start[: len(rows)]],
                            dtype=torch.long, device=device)
        knobs = sampler.knobs(rows, device)
        mask = self._mask(cache.decode_mask(step[2]))
        with decode_autocast(device, self.precision):
            out = self.model(input_ids=step[0, :, None], position_ids=step[1, :, None], attention_mask=mask,
                             use_cache=True, **cache_kwargs(self.model, cache))
        cache.width += 1
        self.stats.steps += 1
        self._sample(out.logits[:, -1, :], rows, knobs)

    def _sample(self, logits: Tensor, rows: list[Sequence], knobs: Tensor) -> None:
        """Sample each row's next token (`sampler.sample`), record it with its logprob, and check for stops."""
        b = len(rows)
        host = sampler.sample(logits, rows, knobs, self.device)
        k = max(r.params.top_logprobs for r in rows)
        version = self._version
        for i, r in enumerate(rows):
            row = host[i]
            r.tokens.append(int(row[0]))
            r.logprobs.append(row[1])
            r.versions.append(version)
            r.max_batch = max(r.max_batch, b)
            if r.params.top_logprobs:
                kk = r.params.top_logprobs
                r.top.append([(int(t), lp) for t, lp in zip(row[2 : 2 + kk], row[2 + k : 2 + k + kk], strict=True)])
            r.check_stop(self.eos_id, self.max_seq_len, self.tokenizer)
        self.stats.generated_tokens += b
        self.stats.max_running = max(self.stats.max_running, b)

    def _retire(self) -> None:
        """Remove finished and cancelled rows; resolve their futures."""
        done = [i for i, r in enumerate(self._rows) if r.finish_reason is not None or r.future.cancelled()]
        if not done:
            return
        finished = []
        for i in reversed(done):  # descending, so the row moved into i is one that stays
            self._cache.remove(i)
            req = self._rows[i]
            self._rows[i] = self._rows[-1]
            self._rows.pop()
            if not req.future.cancelled():
                finished.append(req)
        self._cache.compact(min_gain=max(16, self._cache.width // 4))
        self._resolve(finished[::-1])
