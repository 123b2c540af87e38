"""The `Producer` extension point: a rollout backend that hands the loop scored prompt groups each step and takes
the new weights after it, and `PRODUCERS`, the registry the rollout backend is looked up in. SKELETON: the
issue-36 helper for rollout backends fills in the protocol and the built-ins."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from factory.protocols.registry import Registry


@runtime_checkable
class Producer(Protocol):
    def close(self) -> None: ...


PRODUCERS: Registry[Producer] = Registry("rollout backend", "rollout.backend", {}, group="factory.producers")
