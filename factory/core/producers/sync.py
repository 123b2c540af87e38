"""`SyncProducer` (mode `sync`): a batch is generated with the trainer's current weights, every episode of it runs
in the environment at once, and the batch is ready when its slowest episode is. The engine shares the trainer's
model object, so publishing a version is bumping a number (with `rollout.round_weights` it samples from its own
rounded copy, refreshed at each publish: `rollout/engines/rounding.py`)."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import ExperimentSpec
from factory.core.buffer import Group
from factory.core.producers.common import (
    encode_prompt,
    episode,
    make_group,
    open_environment,
    sampling_params,
    scorer,
)
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.core.rollout.engines.rounding import round_dtype, round_model_, rounded
from factory.core.rollout.engines.sequences import load_state_dict_into
from factory.data.feed import PromptFeed
from factory.models import lora
from factory.models.build import policy_positions
from factory.protocols.engine import Completion
from factory.protocols.producer import ProducerFailed


class SyncProducer:
    """Generate → run every episode → return the batch; the engine samples from the trainer's model."""

    def __init__(self, spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                 feed: PromptFeed, start_version: int, state: dict | None = None):
        self.spec, self.tok, self.feed = spec, tokenizer, feed
        self.positions = policy_positions(spec.model, model)
        if state is not None:  # nothing is buffered between sync steps: only the feed continues
            feed.load_state_dict(state["stream"])
        self._start_engine(model, start_version)
        self.env = open_environment(spec)

    def _start_engine(self, model: PreTrainedModel, version: int) -> None:
        # rollout.round_weights: the engine samples from its own copy, rounded (LoRA merged in); else from the
        # trainer's model object itself
        self._round = round_dtype(self.spec.rollout.round_weights)
        sampler = model if self._round is None else round_model_(lora.merged_copy(model).eval(), self._round)
        self.engine = EmbeddedEngine(sampler, self.tok, weight_version=version,
                                     precision=self.spec.trainer.precision)  # computes where the model is

    def next_batch(self, step: int) -> list[Group]:
        draws = [self.feed.draw(step) for _ in range(self.spec.rollout.prompts_per_step)]
        prompts = [encode_prompt(self.tok, p, self.spec, self.positions) for _, p in draws]
        params = sampling_params(self.spec, self.spec.seed * 1_000_003 + step, n=self.spec.algorithm.group_size)
        groups = self.engine.generate(prompts, params)
        # The episodes run side by side in the environment: the batch is ready when the slowest is.
        scored = self.env.score([episode(p, k, comps, scorer(self.spec, p))
                                 for (k, p), comps in zip(draws, groups, strict=True)])
        if scored is None:
            raise ProducerFailed("the environment was closed while a batch was being scored")
        batch = [make_group(p, k, comps, sc, scorer(self.spec, p))
                 for (k, p), comps, sc in zip(draws, groups, scored, strict=True)]
        self.feed.trained(batch)
        return batch

    def state_dict(self) -> dict:
        """The feed's position (a resume point is taken between steps: nothing is in flight)."""
        return {"stream": self.feed.state_dict(), "buffer": None}

    def publish(self, model: PreTrainedModel, version: int) -> None:
        if self._round is not None:  # the engine's own copy: the trainer's new weights, rounded
            state = lora.merged_state(model) if lora.attached(model) else model.state_dict()
            load_state_dict_into(self.engine.model, rounded(state, self._round))
        self.engine.weight_version = version  # else the same model object: the weights are already there

    def probe(self, prompt_ids: list[int], n: int) -> list[Completion]:
        """`n` completions of one prompt from the engine's current weights (outside the training data)."""
        return self.engine.generate([prompt_ids], sampling_params(self.spec, seed=0x7FFFFFFF, n=n))[0]

    def metrics(self) -> dict[str, float]:
        return {**self.env.metrics(), **self.feed.metrics()}

    def close(self) -> None:
        self.env.close()


