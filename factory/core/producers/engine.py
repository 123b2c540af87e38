"""A rollout backend made of a `RolloutEngine` alone: the built-in producers (prompt feed, environment scoring,
rollout buffer and staleness policy in the overlapped modes) driving an engine a third party supplies. What
`factory.protocols.producer.engine_backend` builds; docs/extending.md has a worked example."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import ExperimentSpec
from factory.core.producers.overlapped import OverlappedProducer
from factory.core.producers.sync import SyncProducer
from factory.data.feed import PromptFeed
from factory.protocols.engine import Completion, RolloutEngine, SamplingParams

EngineFactory = Callable[[ExperimentSpec, PreTrainedModel, PreTrainedTokenizerFast, int], RolloutEngine]


def _weights(model: PreTrainedModel) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _close(engine: RolloutEngine) -> None:
    close = getattr(engine, "close", None)  # optional: an engine with processes or threads to end
    if close is not None:
        close()


class EngineSyncProducer(SyncProducer):
    """`SyncProducer` sampling from the supplied engine; each publish hands it the trainer's weights."""

    def __init__(self, *args, make_engine: EngineFactory, **kwargs):
        self._make_engine = make_engine
        super().__init__(*args, **kwargs)

    def _start_engine(self, model: PreTrainedModel, version: int) -> None:
        self.engine = self._make_engine(self.spec, model, self.tok, version)

    def publish(self, model: PreTrainedModel, version: int) -> None:
        self.engine.load_weights(_weights(model), version)

    def close(self) -> None:
        try:
            super().close()
        finally:
            _close(self.engine)


class EngineOverlappedProducer(OverlappedProducer):
    """`OverlappedProducer` (buffer, staleness policy, producer threads) sampling from the supplied engine, which must
    hold its own copy of the weights (the trainer steps while it samples) and take concurrent `generate` calls."""

    def __init__(self, *args, make_engine: EngineFactory, **kwargs):
        self._make_engine = make_engine
        super().__init__(*args, **kwargs)

    def _start_engine(self, model: PreTrainedModel, version: int) -> None:
        self.engine = self._make_engine(self.spec, model, self.tok, version)

    def _sample(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]:
        return self.engine.generate([prompt_ids], params)[0]

    def publish(self, model: PreTrainedModel, version: int) -> None:
        self.engine.load_weights(_weights(model), version)
        self._published = version

    def _stop_engine(self) -> None:
        _close(self.engine)


def producer(make_engine: EngineFactory, spec: ExperimentSpec, model: PreTrainedModel,
             tokenizer: PreTrainedTokenizerFast, feed: PromptFeed, start_version: int,
             state: dict | None) -> EngineSyncProducer | EngineOverlappedProducer:
    """The producer of `spec.schedule.mode` over the engine `make_engine(spec, model, tokenizer, version)` builds."""
    cls = EngineSyncProducer if spec.schedule.mode == "sync" else EngineOverlappedProducer
    return cls(spec, model, tokenizer, feed, start_version, state=state, make_engine=make_engine)
