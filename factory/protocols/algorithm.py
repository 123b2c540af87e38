"""The `Algorithm` extension point: an RL objective (its advantages, its policy loss, its defaults, its
validation) and `ALGORITHMS`, the registry `algorithm.name` is looked up in. SKELETON: the issue-36 helper for
algorithms fills in the protocol and the built-ins (one module each under factory/core/algorithms/)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from factory.protocols.registry import Registry


@runtime_checkable
class Algorithm(Protocol):
    name: str


ALGORITHMS: Registry[Algorithm] = Registry("algorithm", "algorithm.name", {}, group="factory.algorithms")
