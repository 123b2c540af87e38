"""Placement: the CPU cores and torch threads each component of a run gets, so they do not fight over cores.

Components and where their settings live in the spec:
- trainer: `trainer.cpus`, `trainer.threads` (the loop's thread: the optimizer step, reference logprobs);
- rollout: `rollout.cpus`, `rollout.threads` (the continuous engine's thread in-process, or the rollout server
  process);
- environment: `rollout.env_cpus` (in-process scoring threads, or `factory env-serve` processes);
- sandbox: `task.sandbox_cpus` (the workers that run generated code).

Linux applies CPU affinity per thread and torch's intra-op thread count is per thread (OpenMP), so components
that are threads of one process are placed by the thread itself when it starts (`enter`), and a child process
inherits the affinity of the thread that forks it (`for_child` sets it in the child before it runs). A component
without cores of its own runs on the cores the process had at start, not on the trainer's, which the loop's
thread narrows for itself. GPU devices: `trainer.devices` (ranks) and `rollout.devices` (SGLang servers' GPUs),
checked against the machine's GPUs by `infra/gpus.py`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from factory.infra.gpus import Gpus, check_gpus

if TYPE_CHECKING:
    from factory.config import ExperimentSpec

COMPONENTS = ("trainer", "rollout", "environment", "sandbox")
_FIELDS = {"trainer": "trainer.cpus", "rollout": "rollout.cpus", "environment": "rollout.env_cpus",
           "sandbox": "task.sandbox_cpus"}


@dataclass(frozen=True)
class Place:
    """Where one component runs: `cpus` (None: the process's cores at start) and torch `threads` (0: unchanged)."""

    component: str
    cpus: tuple[int, ...] | None = None
    threads: int = 0


_START_CPUS: frozenset[int] = frozenset(os.sched_getaffinity(0))  # before any thread narrowed its own
_ENTERED: dict[str, tuple[str, frozenset[int], int]] = {}  # thread name -> (component, cpus, threads): for tests
_LOCK = threading.Lock()


def placements(spec: ExperimentSpec) -> dict[str, Place]:
    """Each component's place under `spec`."""
    def cpus(v: list[int] | None) -> tuple[int, ...] | None:
        return tuple(sorted(set(v))) if v else None

    return {"trainer": Place("trainer", cpus(spec.trainer.cpus), spec.trainer.threads),
            "rollout": Place("rollout", cpus(spec.rollout.cpus), spec.rollout.threads),
            "environment": Place("environment", cpus(spec.rollout.env_cpus)),
            "sandbox": Place("sandbox", cpus(spec.task.sandbox_cpus))}


def check_placement(spec: ExperimentSpec, available: Iterable[int] | None = None,
                    gpus: Gpus | None = None) -> list[str]:
    """Refuse cores this process may not use and GPUs this machine does not have (`infra/gpus.py`; `gpus`
    default: counted here), each a ValueError naming the field and what there is; return notes for components
    that share cores (allowed, but they will compete)."""
    check_gpus(spec, gpus)
    have = frozenset(available if available is not None else _START_CPUS)
    places = placements(spec)
    for name, place in places.items():
        if place.cpus is not None and not set(place.cpus) <= have:
            raise ValueError(f"{_FIELDS[name]}: cores {sorted(set(place.cpus) - have)} are not available to this "
                             f"process (it may use {sorted(have)}), got {list(place.cpus)}")
    notes = []
    pinned = [(n, set(p.cpus)) for n, p in places.items() if p.cpus is not None]
    for i, (a, ca) in enumerate(pinned):
        for b, cb in pinned[i + 1:]:
            if ca & cb:
                notes.append(f"placement: {_FIELDS[a]} and {_FIELDS[b]} share cores {sorted(ca & cb)}: they will "
                             f"compete for them")
    return notes


def cores(place: Place) -> frozenset[int]:
    """The cores `place` runs on: its own, else the process's cores at start."""
    return frozenset(place.cpus) if place.cpus is not None else _START_CPUS


def enter(place: Place) -> None:
    """Place the calling thread (its affinity and torch threads); threads and processes it starts inherit both."""
    import torch  # noqa: PLC0415 heavy (~3 s): supervisors and the CLI import this module without needing torch

    want = cores(place)
    if hasattr(os, "sched_setaffinity") and frozenset(os.sched_getaffinity(0)) != want:
        os.sched_setaffinity(0, want)  # pid 0: the calling thread
    if place.threads:
        torch.set_num_threads(place.threads)
    with _LOCK:
        _ENTERED[threading.current_thread().name] = (place.component, want, torch.get_num_threads())


def entered(clear: bool = False) -> dict[str, tuple[str, frozenset[int], int]]:
    """Threads placed in this process so far (since the last `clear`): name -> (component, cores, torch threads)."""
    with _LOCK:
        out = dict(_ENTERED)
        if clear:
            _ENTERED.clear()
        return out


def for_child(place: Place) -> Callable[[], None]:
    """A `preexec_fn` that puts a child process on `place`'s cores (threads are the child's own business: pass
    them on its command line)."""
    want = cores(place)

    def preexec() -> None:
        os.sched_setaffinity(0, want)

    return preexec
