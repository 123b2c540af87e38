"""The rollout engine interface: prompts in, completions with exact tokens and logprobs out."""

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


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, including the stop token if one was produced
    logprobs: list[float]  # sampler logprob of each generated token (temperature-scaled distribution)
    text: str  # decoded generated text without special tokens
    finish_reason: Literal["stop", "length"]
    weight_version: int
    meta: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions."""
        ...

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Replace the policy weights; later completions carry `version`."""
        ...
