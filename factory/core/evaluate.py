"""Held-out evaluation: greedy accuracy and pass@k of a policy on a list of problems."""

from __future__ import annotations

from dataclasses import dataclass, field

from factory.core.rollout.base import RolloutEngine, SamplingParams
from factory.envs.tasks import verify as reward
from factory.models.prompting import prompt_ids
from factory.problem import Problem


@dataclass(frozen=True)
class EvalResult:
    accuracy: float  # greedy, pass@1
    pass_at_k: float | None
    k: int
    n: int
    by_level: dict[str, float]  # greedy accuracy per (op, digits) level
    level_n: dict[str, int] = field(default_factory=dict)  # problems per level


def evaluate(engine: RolloutEngine, tokenizer, problems: list[Problem], max_new_tokens: int,
             k: int = 0, temperature: float = 1.0, seed: int = 0) -> EvalResult:
    """Greedy accuracy on `problems`; with k > 0 also pass@k from k samples at `temperature`."""
    prompts = [prompt_ids(tokenizer, p.prompt) for p in problems]
    greedy = engine.generate(prompts, SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens))
    correct = [reward(g[0].text, p) for g, p in zip(greedy, problems, strict=True)]
    levels: dict[str, list[float]] = {}
    for p, c in zip(problems, correct, strict=True):
        levels.setdefault(f"{p.op}{p.digits}", []).append(c)
    pass_k = None
    if k > 0:
        sampled = engine.generate(prompts, SamplingParams(n=k, temperature=temperature,
                                                          max_new_tokens=max_new_tokens, seed=seed))
        pass_k = sum(any(reward(c.text, p) > 0 for c in group)
                     for group, p in zip(sampled, problems, strict=True)) / len(problems)
    return EvalResult(
        accuracy=sum(correct) / len(problems), pass_at_k=pass_k, k=k, n=len(problems),
        by_level={k_: sum(v) / len(v) for k_, v in sorted(levels.items())},
        level_n={k_: len(v) for k_, v in sorted(levels.items())},
    )
