"""The `Producer` extension point: a rollout backend that hands the loop scored prompt groups each step and takes
the new weights after it, and `PRODUCERS`, the registry the spec's `rollout.engine` is looked up in.

A registry entry is a `ProducerBuilder`: a callable that builds the producer of a run from its spec, the trainer's
model and tokenizer, the run's prompt feed, the version the run starts at and (on resume) the producer's own
`state_dict()` from a resume point. The built-ins are `embedded` (the in-process engine), `server` (a supervised
rollout server over HTTP) and `sglang` (SGLang servers); a third-party backend registers its builder in-process
(`PRODUCERS.register("mine", build)`), from its package (an entry point in group `factory.producers`) or is named by
import path in the spec (`rollout.engine: my_pkg.backend:build`). docs/extending.md walks through one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from factory.protocols.engine import Completion, RolloutEngine
from factory.protocols.registry import Registry, import_path

if TYPE_CHECKING:  # types only: the producer's parts live in higher layers
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from factory.config import ExperimentSpec
    from factory.core.buffer import Group
    from factory.data.feed import PromptFeed


class ProducerFailed(RuntimeError):
    """A producer failed for good (e.g. a producer thread died): the loop keeps what was trained so far, writes a
    resume point and re-raises it, instead of waiting forever on a batch."""


@runtime_checkable
class Producer(Protocol):
    """What the training loop (`factory/core/loop.py`) and the step-0 gate (`factory/core/gate.py`) call.

    Step by step the loop calls `next_batch(step)` (the step's `rollout.prompts_per_step` scored groups of
    `algorithm.group_size` samples each, with the exact token ids, log-probs and weight versions sampled), trains,
    `publish(model, step + 1)`, then `probe(prompt_ids, n)` (n completions of one prompt under the version just
    published, to measure the sampler/trainer gap) and `metrics()` (extra scalars for the step record: e.g. `depth`,
    `rejected`, `producer_idle_fraction`). A resume point stores `state_dict()` (JSON-ready: what the builder gets
    back as `state` to continue the prompt feed and anything buffered exactly). `close()` ends it, on every path.

    The step-0 gate renders its chat probe with `tok` and samples it from `engine.generate` (a `RolloutEngine`):
    a backend that samples in its own engine exposes it as `engine`. The loop reads `feed` if present (the prompt
    feed's per-source report)."""

    tok: PreTrainedTokenizerBase

    def next_batch(self, step: int) -> list[Group]: ...

    def publish(self, model: PreTrainedModel, version: int) -> None: ...

    def probe(self, prompt_ids: list[int], n: int) -> list[Completion]: ...

    def metrics(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class ProducerBuilder(Protocol):
    """Builds the producer of one run: what `PRODUCERS` holds under a `rollout.engine` name. `state` is the
    producer's `state_dict()` from a resume point (None: a fresh start at `start_version`); the builder picks its
    own class per `spec.schedule.mode` (the built-ins sample in-process in `sync`)."""

    def __call__(self, spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 feed: PromptFeed, start_version: int, state: dict[str, Any] | None) -> Producer: ...


def _builder(name: str, obj: object) -> ProducerBuilder:
    if not callable(obj):
        raise ValueError(f"{name!r} is no rollout backend: a backend is a callable (spec, model, tokenizer, feed, "
                         f"start_version, state) -> Producer, got {type(obj).__name__}")
    return obj  # type: ignore[return-value]


PRODUCERS: Registry[ProducerBuilder] = Registry(
    "rollout backend", "rollout.engine",
    {"embedded": "factory.core.producers.builders:embedded",
     "server": "factory.core.producers.builders:server",
     "sglang": "factory.core.sglang.producer:build"},
    group="factory.producers", check=_builder)


EngineFactory = Callable[["ExperimentSpec", "PreTrainedModel", "PreTrainedTokenizerBase", int], RolloutEngine]


def engine_backend(make_engine: EngineFactory) -> ProducerBuilder:
    """A rollout backend from a `RolloutEngine` alone: `make_engine(spec, model, tokenizer, start_version)` builds the
    engine once per run, and the built-in producers drive it (the prompt feed, environment scoring, and in the
    overlapped modes the rollout buffer and its staleness policy). Each publish calls `engine.load_weights(state,
    version)` with the trainer's weights; an engine with a `close()` is closed with the run. In the overlapped
    modes the engine must hold its own copy of the weights and take `generate` calls from several threads."""

    def build(spec: ExperimentSpec, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, feed: PromptFeed,
              start_version: int, state: dict[str, Any] | None) -> Producer:
        # by import path, as the registry's built-ins: this layer imports nothing of the producers above it
        producer = import_path("factory.core.producers.engine:producer", "rollout.engine (engine_backend)")
        return producer(make_engine, spec, model, tokenizer, feed, start_version, state)  # type: ignore[operator]

    return build
