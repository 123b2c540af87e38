"""Decoder layers compiled for the trainer's forwards only (`trainer.compile`), as torchtitan compiles per block.

Each decoder layer's `forward` is compiled once per model (`torch.compile`, inductor by default), with dynamic
sizes: RL batches change length every step (and packed ones change their token count), so the graph takes the
batch and sequence sizes as symbols instead of being specialized and recompiled per length. Length buckets would
also bound the recompiles, but they pad every batch up to its bucket, the padding work issue 34 removes; dynamic
sizes cost nothing per token. A size of 1 is still specialized by dynamo (a one-row minibatch compiles once more,
then is cached), and so is whether the attention mask is a tensor or None.

The model is shared: the in-process rollout engine (its KV-cache forwards, other shapes, another thread) and the
evals call the same layers. So nothing is compiled for them: the compiled forwards are installed only inside
`active()`, and even there a dispatcher sends only the calls of the thread that entered it to the compiled code;
on exit the layers are plain modules again (a deep copy of the model carries nothing of this). Forward hooks stay
outside the compiled region (only `forward` is compiled), so the liveness pulse per block still runs eagerly.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder blocks: the modules of its `_no_split_modules` classes (what FSDP shards), else the
    children of its longest ModuleList."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if m is not model and type(m).__name__ in blocks]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"trainer.compile: {type(model).__name__} has no decoder layers to compile (no "
                         f"_no_split_modules and no ModuleList); set trainer.compile: off")
    return list(max(lists, key=len))


class CompiledLayers:
    """The compiled forwards of `model`'s decoder layers, used by the thread inside `active()`."""

    def __init__(self, model: torch.nn.Module, backend: str | Callable = "inductor", dynamic: bool | None = True):
        self.layers = decoder_layers(model)
        self._eager = [type(layer).forward.__get__(layer) for layer in self.layers]
        self.compiled = [torch.compile(f, backend=backend, dynamic=dynamic) for f in self._eager]
        self._here = threading.local()  # how deep each thread is in this object's `active()` contexts
        self._dispatch = [_dispatcher(self._here, e, c) for e, c in zip(self._eager, self.compiled, strict=True)]
        self._users = 0  # contexts open on any thread: the dispatchers stay installed while one is
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: this thread's calls of the layers run compiled; other threads' stay eager."""
        with self._lock:
            if self._users == 0:
                for layer, forward in zip(self.layers, self._dispatch, strict=True):
                    layer.forward = forward
            self._users += 1
        self._here.depth = getattr(self._here, "depth", 0) + 1
        try:
            yield
        finally:
            self._here.depth -= 1
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for layer in self.layers:
                        del layer.forward  # the class's forward again


def _dispatcher(here: threading.local, eager: Callable, compiled: Callable) -> Callable:
    def forward(*args, **kwargs):
        if getattr(here, "depth", 0):
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)
    return forward
