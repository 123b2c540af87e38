"""The built-in rollout backends, as `factory.protocols.PRODUCERS` builds them from `rollout.engine`: `embedded` and
`server` (the SGLang one is `factory.core.sglang.producer:build`). Every built-in samples in-process in mode `sync`
(the engine shares the trainer's model object); the engine name picks the overlapped modes' producer."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.config import ExperimentSpec
from factory.core.producers.overlapped import OverlappedProducer
from factory.core.producers.server import ServerProducer
from factory.core.producers.sync import SyncProducer
from factory.data.feed import PromptFeed


def embedded(spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, feed: PromptFeed,
             start_version: int, state: dict | None) -> SyncProducer | OverlappedProducer:
    """`rollout.engine: embedded`: the in-process engine (overlapped: its own copy of the weights)."""
    cls = SyncProducer if spec.schedule.mode == "sync" else OverlappedProducer
    return cls(spec, model, tokenizer, feed, start_version, state=state)


def server(spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, feed: PromptFeed,
           start_version: int, state: dict | None) -> SyncProducer | ServerProducer:
    """`rollout.engine: server`: a supervised rollout server process over HTTP (sync samples in-process)."""
    cls = SyncProducer if spec.schedule.mode == "sync" else ServerProducer
    return cls(spec, model, tokenizer, feed, start_version, state=state)
