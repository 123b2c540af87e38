"""The continuous engine's sequence state: one `Sequence` per sampled completion, a pending weight update, the
engine's counters, and the stop rules that end a sequence."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.core.rollout.base import Completion, SamplingParams
from factory.core.weights.codec import storage_key


def mix_seed(seed: int, index: int) -> int:
    """A distinct, well-spread generator seed for sample `index` of a request seeded with `seed`."""
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def check_request(vocab: int, max_seq_len: int, prompt_ids: list[int], params: SamplingParams,
                  kv_problem: Callable[[], str | None] = lambda: None) -> None:
    """Raise ValueError, with a message for the caller, if a request cannot run on an engine of `max_seq_len`
    positions over `vocab` tokens; `kv_problem` says why its KV cache could never hold it (or None)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if params.max_new_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {params.max_new_tokens}")
    # the length first: it costs nothing, the id scan costs a pass over a prompt that may be millions long
    if len(prompt_ids) + params.max_new_tokens > max_seq_len:
        raise ValueError(f"this model's maximum context length is {max_seq_len} tokens; the request needs "
                         f"{len(prompt_ids) + params.max_new_tokens} ({len(prompt_ids)} in the prompt, "
                         f"{params.max_new_tokens} for the completion)")
    if (problem := kv_problem()) is not None:
        raise ValueError(problem)
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if any(not c or any(not 0 <= t < vocab for t in c) for c in params.choices):
        raise ValueError(f"choices must be non-empty sequences of token ids in [0, {vocab})")
    if not params.greedy and params.temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_logprobs < 0 or params.top_logprobs > vocab:
        raise ValueError(f"top_logprobs must be in [0, {vocab}], got {params.top_logprobs}")


@dataclass
class Sequence:
    """One completion being sampled: its prompt, its sampler state and what it has generated so far."""

    prompt_ids: list[int]
    params: SamplingParams
    future: Future
    generator: torch.Generator
    submitted_at: float
    admitted_at: float = 0.0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    max_batch: int = 0  # the most rows that ran together while this sequence ran

    @property
    def next_position(self) -> int:
        """Position of the last sampled token, which the next decode step feeds."""
        return len(self.prompt_ids) + len(self.tokens) - 1

    def final_length(self, max_seq_len: int) -> int:
        """The most positions (prompt + completion) this sequence can reach: what its KV rows may grow to."""
        return min(len(self.prompt_ids) + self.params.max_new_tokens, max_seq_len)

    def check_stop(self, eos_id: int | None, max_seq_len: int, tokenizer: PreTrainedTokenizerFast) -> None:
        """Set `finish_reason` (and `stop_reason`) if the last sampled token ended the sequence."""
        t, p = self.tokens[-1], self.params
        if p.choices and tuple(self.tokens) in p.choices:
            self.finish_reason = "stop"  # a constrained completion is complete (`SamplingParams.choices`)
        elif t == eos_id and not p.ignore_eos or t in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", t
        elif p.stop and (hit := self._find_stop(tokenizer)) is not None:
            self.finish_reason, self.stop_reason = "stop", hit[1]
        elif len(self.tokens) >= p.max_new_tokens or len(self.prompt_ids) + len(self.tokens) >= max_seq_len:
            self.finish_reason = "length"

    def _find_stop(self, tokenizer: PreTrainedTokenizerFast) -> tuple[int, str] | None:
        """Earliest (char offset, stop string) in the decoded completion, if any."""
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [(i, s) for s in self.params.stop if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def completion(self, tokenizer: PreTrainedTokenizerFast) -> Completion:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        if isinstance(self.stop_reason, str):
            text = text[: text.find(self.stop_reason)]
        now = time.perf_counter()
        return Completion(
            prompt_ids=self.prompt_ids, token_ids=self.tokens, logprobs=self.logprobs, text=text,
            finish_reason=self.finish_reason, weight_version=min(self.versions), token_versions=self.versions,
            top_logprobs=self.top if self.params.top_logprobs else None,
            meta={"stop_reason": self.stop_reason, "max_batch": self.max_batch,
                  "queue_s": self.admitted_at - self.submitted_at, "latency_s": now - self.submitted_at},
        )


@dataclass
class PendingUpdate:
    state_dict: Mapping[str, Tensor]
    version: int
    mode: str
    future: Future


@dataclass
class EngineStats:
    steps: int = 0  # decode steps
    prefills: int = 0  # prefill forwards
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens run through prefill (after de-duplication)
    completed: int = 0
    max_running: int = 0
    waited_for_kv: int = 0  # scheduler steps in which the next request waited for room in the KV budget


def load_state_dict_into(model: PreTrainedModel, state_dict: Mapping[str, Tensor]) -> None:
    """Copy `state_dict` into `model`'s own parameters and buffers in place (cast to their dtype on their device);
    a missing tied output embedding is fine, any other mismatch is an error and nothing is copied.

    One copy per destination storage: tied weights (the embedding and the LM head) are copied once, and an entry
    that already is the destination tensor (a LoRA merge that passes the engine's own unchanged tensors) not at
    all. The copies are queued on the current stream and not waited for: on a GPU the caller's later kernels (the
    next decode step, the trainer's next optimizer step on the same stream) are ordered after them."""
    targets = dict(model.state_dict(keep_vars=True))
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in targets if k not in state_dict and k not in tied]
    unexpected = [k for k in state_dict if k not in targets]
    if missing or unexpected:
        raise ValueError(f"state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [f"{k}: {tuple(v.shape)} into {tuple(targets[k].shape)}" for k, v in state_dict.items()
           if v.shape != targets[k].shape]
    if bad:
        raise ValueError(f"state dict does not fit the model: size mismatch for {'; '.join(bad[:5])}")
    done: set[tuple] = set()
    with torch.no_grad():
        for name, src in state_dict.items():
            dst = targets[name]
            key = storage_key(dst)
            if key in done:
                continue  # tied to a tensor already copied
            done.add(key)
            if storage_key(src) != key:
                dst.copy_(src)
