"""The RL orchestrator. Read top to bottom: this is what happens in a training step.

Parts it drives (none of them knows about this file):
- a rollout engine (`core/rollout/`): prompts in, completions with token ids, logprobs, version out;
- an environment (`envs/`): a reward per completion;
- the algorithm (`core/algorithms.py`): advantages and a loss function over per-token tensors;
- a trainer (`core/trainer/`): applies the loss function, steps the optimizer;
- weight publication: in `sync` mode the engine holds the trainer's own model object, so a new
  version is published by bumping the number (the in-process transport).

Modes: `sync` (generate all → score → train → publish). Others arrive with the async core.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import ExperimentSpec
from factory.core import algorithms
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.embedded import EmbeddedEngine
from factory.core.trainer.batch import TrainBatch, pack
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.envs.arithmetic import Problem, reward


@dataclass
class StepRecord:
    """One trainer step, as recorded in the `steps` table and MLflow."""

    step: int
    weight_version: int
    loss: float
    reward_mean: float
    reward_std: float
    accuracy: float  # fraction of sampled completions that were exactly right
    kl: float
    entropy: float
    clip_frac: float
    grad_norm: float
    logprob_mismatch: float  # mean |sampler logprob - trainer logprob| on the same tokens and weights
    staleness_mean: float
    staleness_max: float
    tokens_per_s: float  # generated tokens per second of step wall time
    trainer_idle_fraction: float  # share of the step's wall time the trainer waited on rollouts
    wall_s: float
    samples: list[dict] = field(default_factory=list)  # a few episodes, for the `rollouts` table

    def to_dict(self) -> dict[str, float]:
        """The scalar metrics (what the `steps` table and MLflow take)."""
        return {k: v for k, v in asdict(self).items() if k != "samples"}


def _grpo_loss_fn(spec: ExperimentSpec) -> Callable[[torch.Tensor, TrainBatch], tuple[torch.Tensor, dict[str, float]]]:
    # The algorithm named in the spec (grpo, dr_grpo, dapo, cispo, gspo); Dr.GRPO's constant length
    # divisor defaults to the rollout's generation budget.
    return algorithms.make_loss(spec.algorithm, max_new_tokens=spec.rollout.max_new_tokens)


def train_grpo(
    spec: ExperimentSpec,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    train: list[Problem],
    on_step: Callable[[StepRecord], None] | None = None,
    start_step: int = 0,
) -> list[StepRecord]:
    """Run `spec.schedule.steps` GRPO steps in sync mode on `model` (trained in place)."""
    g = spec.algorithm.group_size
    rng = random.Random(f"grpo-{spec.seed}-{start_step}")
    torch.manual_seed(spec.seed + start_step)
    shuffle = torch.Generator().manual_seed(spec.seed)
    trainer = TorchTrainer(model, lr=spec.algorithm.lr, grad_clip=spec.trainer.grad_clip,
                           weight_decay=spec.trainer.weight_decay, temperature=spec.rollout.temperature)
    engine = EmbeddedEngine(model, tokenizer, weight_version=start_step)
    reference = None
    if spec.algorithm.kl_coef > 0:
        reference = TorchTrainer(copy.deepcopy(model).eval(), lr=0.0, temperature=spec.rollout.temperature)
    loss_fn = _grpo_loss_fn(spec)
    records = []

    for step in range(start_step, start_step + spec.schedule.steps):
        t0 = time.perf_counter()
        # 1. Sample G completions for each prompt with the current weights.
        problems = rng.sample(train, spec.rollout.prompts_per_step)
        prompts = [tokenizer(p.prompt).input_ids for p in problems]
        params = SamplingParams(n=g, temperature=spec.rollout.temperature, top_p=spec.rollout.top_p,
                                max_new_tokens=spec.rollout.max_new_tokens, seed=spec.seed * 1_000_003 + step)
        groups = engine.generate(prompts, params)
        completions = [c for group in groups for c in group]
        # 2. Score each completion with the environment's verifier.
        rewards = torch.tensor([reward(c.text, p) for group, p in zip(groups, problems, strict=True)
                                for c in group])
        t_rollout = time.perf_counter() - t0
        # 3. Group-normalized advantages; pack tokens exactly as sampled (no re-tokenization).
        adv = algorithms.compute_advantages(spec.algorithm, rewards, g,
                                            torch.tensor([len(c.token_ids) for c in completions]),
                                            spec.rollout.max_new_tokens)
        batch = pack([c.prompt_ids for c in completions], [c.token_ids for c in completions],
                     tokenizer.pad_token_id, {"old_logprobs": [c.logprobs for c in completions]},
                     {"advantages": adv.tolist()})
        if reference is not None:
            batch.per_token["ref_logprobs"] = reference.logprobs(batch)
        # 4. Sampler/trainer logprob mismatch on identical weights: the first sign of a broken setup.
        mismatch = algorithms.masked_mean(
            (trainer.logprobs(batch) - batch.per_token["old_logprobs"]).abs(), batch.loss_mask).item()
        # 5. Train, then publish the new weights to the engine.
        metrics = trainer.step(batch, loss_fn, spec.trainer.minibatches, generator=shuffle)
        engine.weight_version = step + 1
        model.eval()
        wall = time.perf_counter() - t0
        staleness = [step - c.weight_version for c in completions]
        samples = [dict(prompt_id=p.id, sample=j, prompt=p.prompt, completion=c.text, reward=float(rewards[i * g + j]),
                        weight_version=c.weight_version, staleness=step - c.weight_version, latency_s=t_rollout)
                   for i, (group, p) in enumerate(zip(groups, problems, strict=True))
                   if i < spec.schedule.log_rollouts for j, c in enumerate(group)]
        record = StepRecord(
            step=step + 1, weight_version=step + 1, loss=metrics["loss"],
            reward_mean=rewards.mean().item(), reward_std=rewards.std().item(),
            accuracy=(rewards >= 1).float().mean().item(), kl=metrics.get("kl", 0.0), entropy=metrics["entropy"],
            clip_frac=metrics["clip_frac"], grad_norm=metrics["grad_norm"], logprob_mismatch=mismatch,
            staleness_mean=sum(staleness) / len(staleness), staleness_max=float(max(staleness)),
            tokens_per_s=sum(len(c.token_ids) for c in completions) / wall,
            trainer_idle_fraction=t_rollout / wall, wall_s=wall, samples=samples,
        )
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records

