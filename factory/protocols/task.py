"""The `TaskFamily` extension point: a family of problems (its splits, its prompts, its verifier) and
`TASK_FAMILIES`, the registry `task.name` is looked up in. SKELETON: the issue-36 helper for environments fills
in the protocol and the built-ins."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from factory.protocols.registry import Registry


@runtime_checkable
class TaskFamily(Protocol):
    name: str


TASK_FAMILIES: Registry[TaskFamily] = Registry("task family", "task.name", {}, group="factory.task_families")
