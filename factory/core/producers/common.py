"""What every built-in producer shares: the sampling parameters and environment of a spec, a prompt's tokens,
an episode to score, and a scored buffer group of completions (`make_group`)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from factory.config import ExperimentSpec
from factory.core.buffer import Group, Sample
from factory.envs.tasks import runs_hack_detectors
from factory.envs.workers import Episode, Scored, make_environment
from factory.models.prompting import prompt_ids
from factory.problem import Problem
from factory.protocols.engine import Completion, SamplingParams
from factory.source_spec import SourceError


def episode(problem: Problem, k: int, completions: list[Completion], env: str = "arithmetic") -> Episode:
    return Episode(key=f"{problem.id}-{k}", problem=problem, completions=[c.text for c in completions], env=env)


def scorer(spec: ExperimentSpec, problem: Problem | None = None) -> str:
    """What scores single completions of `problem`: a user's single-turn environment if the spec names one, else
    the verifier its source names, else the task's."""
    if spec.task.environment:
        return spec.task.environment
    return (problem.meta.get("verifier") if problem is not None else None) or spec.task.name


def make_group(problem: Problem, k: int, completions: list[Completion], scored: Scored,
               scorer_name: str | None = None) -> Group:
    """A buffer group of the completions and the environment's rewards for them (with the reason where the
    environment failed to judge one and scored it 0). `scorer_name`: what scored them (None: the task's verifier);
    the group's `hack_checked` says whether the reward-hack detectors looked at them."""
    samples = [Sample.from_completion(c, r) for c, r in zip(completions, scored.rewards, strict=True)]
    for sample, reason in zip(samples, scored.reasons, strict=True):
        if reason is not None:
            sample.meta["reason"] = reason
    for sample, hacks in zip(samples, scored.hacks, strict=False):  # none from environments without detectors
        if hacks:
            sample.meta["hacks"] = list(hacks)
    return Group(samples, uid=f"draw-{k}", meta={"prompt_id": problem.id, "prompt": problem.prompt, "draw": k,
                                                 "latency_s": scored.latency_s, "source": problem.meta.get("source"),
                                                 "hack_checked": runs_hack_detectors(problem, scorer_name)})


def sampling_params(spec: ExperimentSpec, seed: int, n: int = 1) -> SamplingParams:
    r = spec.rollout
    return SamplingParams(n=n, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, seed=seed)


def open_environment(spec: ExperimentSpec):
    return make_environment(spec.task.simulated_latency_s, spec.rollout.environment, spec.rollout.env_processes,
                            timeout=spec.schedule.wait_timeout_s, sandbox_workers=spec.task.sandbox_workers,
                            sandbox_isolation=spec.task.sandbox_isolation, breaker_restarts=spec.ops.breaker_restarts,
                            breaker_window_s=spec.ops.breaker_window_s, reward_timeout_s=spec.task.reward_timeout_s,
                            hang_timeout_s=spec.ops.hang_timeout_s, env_cpus=spec.rollout.env_cpus,
                            sandbox_cpus=spec.task.sandbox_cpus)


def encode_prompt(tok: PreTrainedTokenizerFast, problem: Problem, spec: ExperimentSpec,
                limit: int | None) -> list[int]:
    """The prompt's tokens; a prompt too long for the model's `limit` positions (a file source's row) or that the
    tokenizer cannot read is an error naming it."""
    # SourceErrors: a row of the data the run cannot use, which a restart would meet again (bad input, exit 2)
    try:
        ids = prompt_ids(tok, problem.prompt)
    except Exception as e:  # a character tokenizer meets a character it does not have
        raise SourceError(f"prompt {problem.id!r} of source {problem.meta.get('source')!r} cannot be tokenized by the "
                          f"model's tokenizer (task {spec.task.name}'s alphabet): {e}") from None
    if limit is not None and len(ids) + spec.rollout.max_new_tokens > limit:
        raise SourceError(f"prompt {problem.id!r} of source {problem.meta.get('source')!r} has {len(ids)} tokens: "
                          f"with rollout.max_new_tokens = {spec.rollout.max_new_tokens} it does not fit the model's "
                          f"{limit} positions (raise model.max_positions, or filter the source)")
    return ids
