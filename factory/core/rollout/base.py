"""The rollout engine interface: prompts in, completions with exact tokens and logprobs out. Defined with the other
extension points in factory/protocols/engine.py; re-exported here, where the engines import it."""

from factory.protocols.engine import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams"]
