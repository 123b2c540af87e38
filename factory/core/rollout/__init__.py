"""Rollout engines behind one interface; each returns token ids, logprobs and the weight version."""

from factory.core.rollout.base import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams"]
