"""The `Trainer` extension point: a training backend, and `TRAINERS`, the registry `trainer.backend` names one in.

A backend is registered as a builder, `(spec, model) -> Trainer` (`TrainerBackend`): it gets the whole experiment
spec (its `trainer` section says the layout, `algorithm.lr` the learning rate, `rollout.temperature` the sampling
temperature the log-probs are taken at) and the run's policy, a `transformers` causal LM already on the run's
device. What the run calls on the trainer it returns (`Trainer`):

- `step(batch, loss_fn, minibatches, generator)`: one optimizer step per minibatch of a split of `batch` shuffled
  by `generator` (the loop's RL step and SFT). `loss_fn(logprobs, minibatch) -> (loss, metrics)` is the
  algorithm's; the returned dict holds the minibatches' mean of its metrics and of `loss`, `grad_norm`, `entropy`,
  and `nonfinite` (the share of minibatches not applied: the non-finite rule, `factory.core.trainer.step.
  guarded_step`, which the built-in backends share), `train_s` and `tokens`. `version` counts the updates applied.
- `logprobs(batch)`: the target tokens' log-probs [B, T-1] under the current weights, on the CPU, no gradient (the
  behaviour scorer, the step-0 gate, the sampler/trainer gap after each publish).
- `version`: updates applied so far, read and, on resume, set by the loop.
- `optimizer`: what a resume point saves and loads (`state_dict()` / `load_state_dict(state)`).

Weights out: the loop publishes, evaluates and checkpoints the model it handed the builder, so when `step`
returns, that model must hold the trained weights (the torch trainer trains it in place; Megatron's copies its
weights back after every step; rank 0 of FSDP ranks gathers them into it).

The built-ins are `torch` (one process, or rank 0 of DDP/FSDP2 ranks under torchrun) and `megatron`
(Megatron-core, GPU only, needs the `megatron` extra). docs/extending.md ("Adding a trainer backend") walks through
a new one; tests/extending/test_trainer_backend.py trains it.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from factory.protocols.registry import Registry

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from factory.config import ExperimentSpec
    from factory.core.batch import TrainBatch
    from factory.core.trainer.torch_trainer import LossFn


class OptimizerState(Protocol):
    """The part of an optimizer a resume point touches (a `torch.optim.Optimizer` is one)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """What the loop, the step-0 gate, the behaviour scorer and resume points call on a trainer (module docstring)."""

    version: int
    optimizer: OptimizerState

    def step(self, batch: TrainBatch, loss_fn: LossFn, minibatches: int = 1,
             generator: torch.Generator | None = None) -> dict[str, float]: ...

    def logprobs(self, batch: TrainBatch) -> torch.Tensor: ...


def trainer_problems(trainer: object) -> list[str]:
    """What keeps `trainer` from being a `Trainer`, one phrase each ([] when it is one): a member missing, or a
    method that does not take the parameters the run passes (by name, with the protocol's defaults) or requires one
    it never passes. `isinstance(x, Trainer)` checks the names only."""
    out = [f"no attribute {name}" for name in ("version", "optimizer") if not hasattr(trainer, name)]
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None:
        out += [f"optimizer has no {m}()" for m in ("state_dict", "load_state_dict") if not hasattr(optimizer, m)]
    for name in ("step", "logprobs"):
        method = getattr(trainer, name, None)
        if not callable(method):
            out.append(f"no method {name}")
            continue
        try:
            have = inspect.signature(method).parameters
        except (TypeError, ValueError):  # a builtin without a signature: nothing more to check
            continue
        want = list(inspect.signature(getattr(Trainer, name)).parameters.values())[1:]  # after self
        for p in want:
            q = have.get(p.name)
            if q is None:
                out.append(f"{name}() has no parameter {p.name}")
            elif p.default is not p.empty and q.default != p.default:
                out.append(f"{name}(): {p.name} defaults to {q.default!r}, not {p.default!r}"
                           if q.default is not q.empty else f"{name}(): {p.name} has no default")
        wanted = {p.name for p in want}
        out += [f"{name}() requires {q.name}, which the run does not pass" for q in have.values()
                if q.name not in wanted and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return out


class TrainerBackend(Protocol):
    """A trainer backend as `TRAINERS` holds it: builds the run's trainer for `spec` around `model`."""

    def __call__(self, spec: ExperimentSpec, model: PreTrainedModel) -> Trainer: ...


def _callable(name: str, obj: object) -> TrainerBackend:
    if not callable(obj):
        raise ValueError(f"trainer.backend: {name!r} is not a builder (spec, model) -> Trainer but a "
                         f"{type(obj).__name__}")
    return obj  # type: ignore[return-value]  # a callable; its result is checked when it builds


TRAINERS: Registry[TrainerBackend] = Registry(
    "trainer backend", "trainer.backend",
    {"torch": "factory.core.trainer.ranks:torch_backend", "megatron": "factory.core.trainer.megatron:megatron_backend"},
    group="factory.trainers", check=_callable)
