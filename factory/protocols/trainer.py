"""The `Trainer` extension point: a training backend (one step of the loss on a batch, its weights out) and
`TRAINERS`, the registry `trainer.backend` is looked up in. SKELETON: the issue-36 helper for trainer backends
fills in the protocol and the built-ins."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from factory.protocols.registry import Registry


@runtime_checkable
class Trainer(Protocol):
    def step(self, *args: object, **kwargs: object) -> dict: ...


TRAINERS: Registry[Trainer] = Registry("trainer backend", "trainer.backend", {}, group="factory.trainers")
