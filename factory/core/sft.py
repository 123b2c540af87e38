"""Supervised warm start: teach the answer format by next-token loss on (prompt, answer<eos>).

SFT can stop early at a target accuracy measured on training problems (never the held-out
split), which puts every seed at a comparable starting point for RL: the moment a model's
phase transition happens varies a lot from seed to seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import SFTSpec
from factory.core.algorithms import sft_loss
from factory.core.batch import pack
from factory.core.evaluate import evaluate
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.infra.liveness import pulse
from factory.models.prompting import answer_ids, prompt_ids
from factory.problem import Problem

CHECK_SAMPLE = 256


def run_sft(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, train: list[Problem], spec: SFTSpec,
            seed: int, on_step: Callable[[int, dict[str, float]], None] | None = None,
            max_new_tokens: int = 8, speedups: dict[str, str] | None = None) -> dict[str, float]:
    """Up to `spec.steps` AdamW steps on random train batches; returns the last step's metrics
    plus `steps` (how many ran) and `train_accuracy` (last check, if any). `speedups`: the trainer's switches
    (`SPEEDUPS` names -> auto/on/off, the run's `trainer` section); unset, all auto."""
    rng = random.Random(f"sft-{seed}")
    torch.manual_seed(seed)
    trainer = TorchTrainer(model, lr=spec.lr, **(speedups or {}))
    warmup = max(1, min(spec.steps, 1000) // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: min(1.0, (s + 1) / warmup))
    check = random.Random(f"sft-check-{seed}").sample(train, min(CHECK_SAMPLE, len(train)))
    metrics: dict[str, float] = {"steps": 0.0}
    for step in range(spec.steps):
        batch_problems = rng.sample(train, min(spec.batch_size, len(train)))
        prompts = [prompt_ids(tokenizer, p.prompt) for p in batch_problems]
        answers = [answer_ids(tokenizer, p.answer) for p in batch_problems]
        batch = pack(prompts, answers, tokenizer.pad_token_id)
        metrics = trainer.step(batch, lambda logp, b: sft_loss(logp, b.loss_mask))
        metrics["steps"] = float(step + 1)
        sched.step()
        pulse()  # SFT inside a watched attempt is alive while it steps (infra/liveness.py)
        if spec.stop_at_accuracy is not None and (step + 1) % spec.check_every == 0:
            acc = evaluate(EmbeddedEngine(model, tokenizer), tokenizer, check, max_new_tokens).accuracy
            metrics["train_accuracy"] = acc
            if acc >= spec.stop_at_accuracy:
                if on_step is not None:
                    on_step(step, metrics)
                break
        if on_step is not None:
            on_step(step, metrics)
    model.eval()
    return metrics
