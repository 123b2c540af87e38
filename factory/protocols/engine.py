"""The `RolloutEngine` extension point: prompts in, completions with exact tokens and log-probs out, weights in
by version (the embedded engines of core/rollout/engines/ and the SGLang router of core/sglang/ implement it; a
producer drives one, and `producer.engine_backend` makes any engine a rollout backend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False
    seed: int | None = None
    # Honored by the continuous engine (`continuous.py`); the simple embedded engine ignores them.
    stop: tuple[str, ...] = ()  # stop when the decoded completion contains one; the text is cut before it
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides EOS (kept in token_ids, like EOS)
    ignore_eos: bool = False  # do not stop on EOS (fixed-length sampling)
    top_logprobs: int = 0  # also report the k most likely tokens at each step
    # Constrained decoding (the continuous engine): the completion is exactly one of these token sequences; each
    # step samples among the tokens that continue one of them (logprobs are of that renormalized distribution).
    choices: tuple[tuple[int, ...], ...] = ()


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, including the stop token if one was produced
    logprobs: list[float]  # sampler logprob of each generated token (temperature-scaled distribution)
    text: str  # decoded generated text without special tokens
    finish_reason: Literal["stop", "length"]
    # The oldest weight version that sampled any of these tokens, min(token_versions): the first token's unless
    # versions went backwards. Staleness rules use it; after an in-flight weight update later tokens are newer.
    weight_version: int
    meta: dict = field(default_factory=dict)
    token_versions: list[int] = field(default_factory=list)  # the weight version that sampled each token
    # With SamplingParams.top_logprobs = k: per generated token, the k most likely (token id, logprob) pairs.
    top_logprobs: list[list[tuple[int, float]]] | None = None


class RolloutEngine(Protocol):
    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions."""
        ...

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Replace the policy weights; later completions carry `version`."""
        ...
