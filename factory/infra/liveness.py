"""Signs of life from long work, for a hang watchdog that reads a heartbeat (`runs/restarts.py`, `OrphanGuard`).

A watchdog tells a hung attempt from a slow one by its heartbeat's age, so the beats must come from the work
itself: a thread beating on its own would keep a hung attempt alive forever. The inner loops of long phases call
`pulse()`: a decode step of the embedded engine, a verified eval answer, an SFT step, a file written. A model that
trains pulses layer by layer (`pulse_from_layers`: after each block's forward, and its backward through a gradient
hook), so one forward and backward of a large batch on a loaded machine is alive while it computes, and a
collective that never returns is not. An attempt routes the pulses of its process to its heartbeat with
`beating(beat)`; outside it a pulse reads one global and returns.

A phase that is one long call with no loop of ours inside (`save_pretrained` of a large checkpoint, reading a GGUF
file, loading a model) runs `covered(limit_s)`: a thread pulses for it while the call runs, for at most `limit_s`
seconds. A call that never returns then falls silent after `limit_s` and is killed as hung, later than a loop
would be but not never.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a model is hooked: `factory validate` and other light commands never load it
    import torch

EVERY_S = 1.0  # at most one beat a second, however often the work pulses (a beat is a file's mtime)
COVER_LIMIT_S = 900.0  # how long `covered` vouches for one call by default

_beat: Callable[[], None] | None = None
_every_s = EVERY_S
_last = -math.inf
_lock = threading.Lock()


def pulse() -> None:
    """A sign of life from the work (any thread of this process): beats when a `beating` block is open and the
    last beat is at least its `every_s` old. Cheap enough for every decode step."""
    global _last
    beat = _beat
    if beat is None:
        return
    now = time.monotonic()
    if now - _last < _every_s:
        return
    _last = now
    beat()


@contextlib.contextmanager
def beating(beat: Callable[[], None], every_s: float = EVERY_S) -> Iterator[None]:
    """While open, `pulse()` calls from this process call `beat` (at most once per `every_s` seconds). Nested
    blocks restore the outer one's beat on exit."""
    global _beat, _every_s, _last
    with _lock:
        outer = (_beat, _every_s)
        _beat, _every_s, _last = beat, every_s, -math.inf  # the first pulse beats
    try:
        yield
    finally:
        with _lock:
            (_beat, _every_s), _last = outer, -math.inf


@contextlib.contextmanager
def covered(limit_s: float = COVER_LIMIT_S, every_s: float = EVERY_S) -> Iterator[None]:
    """Pulse from a thread while the block runs, for at most `limit_s` seconds (see the module docstring): for one
    long call the work cannot pulse from inside. A no-op (no thread) when no `beating` block is open."""
    if _beat is None:
        yield
        return
    done = threading.Event()

    def vouch() -> None:
        deadline = time.monotonic() + limit_s
        while not done.wait(every_s) and time.monotonic() < deadline:
            pulse()

    thread = threading.Thread(target=vouch, name="liveness-cover", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def pulse_from_layers(model: torch.nn.Module) -> None:
    """Pulse as each block of `model` finishes its forward and, when it trains, its backward (a hook on the block's
    output gradient, which leaves the gradient as it is). The blocks are the model's longest `ModuleList` (a
    decoder's layers). Once per model: a second call adds nothing."""
    import torch  # noqa: PLC0415 heavy: only where a model is hooked (see the TYPE_CHECKING import)

    if getattr(model, "_liveness_hooked", False):
        return
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if lists:
        for block in max(lists, key=len):
            block.register_forward_hook(_block_done)
    model._liveness_hooked = True


def _block_done(module: torch.nn.Module, args: object, output: object) -> None:
    pulse()
    out = output[0] if isinstance(output, tuple | list) and output else output
    if getattr(out, "requires_grad", False):  # a tensor in the autograd graph
        out.register_hook(_gradient_done)


def _gradient_done(grad: torch.Tensor) -> None:
    pulse()  # returns None: the gradient is unchanged
