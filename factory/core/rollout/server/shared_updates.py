"""The rollout server's end of the shared-buffer weight handoff (`factory.core.weights.shared`): a reader attached
once by the trainer's handle, and staging tensors that each version is read into before the engine swaps it in
between decode steps (so "finish_old" requests keep the old weights, and the engine never samples from a half-copied
state). The staging copy is the engine's own layout, dtype and device, tied tensors once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from factory.core.weights.codec import storage_key
from factory.core.weights.shared import SharedHandleError, SharedWeightsReader
from factory.text import clip


class SharedUpdates:
    """At most one attached writer at a time; a new handle (a restarted trainer, or a restarted server) replaces it."""

    def __init__(self, engine: Any):
        self.engine = engine  # its model is read at attach: an engine may swap it (never while attaching)
        self.reader: SharedWeightsReader | None = None
        self.staging: dict[str, torch.Tensor] = {}

    @property
    def attached(self) -> bool:
        return self.reader is not None

    def attach(self, handle: Mapping[str, Any]) -> int | None:
        """Map the buffers `handle` names (every field checked: `SharedHandleError` names a bad one) and return the
        newest whole version they hold (None: none yet)."""
        reader = SharedWeightsReader.attach(handle)
        try:
            current = self.engine.model.state_dict()
            names = {e.name: e.shape for e in reader.entries}
            if set(names) != set(current):
                missing = sorted(set(current) - set(names))[:5]
                extra = sorted(set(names) - set(current))[:5]
                raise SharedHandleError(f"shared weights handle: field 'tensors': not this server's model: missing "
                                        f"{clip(missing, 150)}, unexpected {clip(extra, 150)}")
            for name, shape in names.items():
                if tuple(current[name].shape) != shape:
                    raise SharedHandleError(f"shared weights handle: field 'tensors': {name!r} has shape {shape}, "
                                            f"the served model's {tuple(current[name].shape)}")
            memo: dict[tuple, torch.Tensor] = {}
            staging = {name: memo.setdefault(storage_key(t), torch.empty_like(t)) for name, t in current.items()}
        except BaseException:
            reader.close()
            raise
        self.close()
        self.reader, self.staging = reader, staging
        return reader.available()

    def read(self) -> int | None:
        """Copy the newest whole version into the staging tensors; its version, or None if nothing is newer than
        the version read last."""
        assert self.reader is not None
        return self.reader.read_into(self.staging)

    def forget(self) -> None:
        """The engine did not take the version read last: read it again next time."""
        if self.reader is not None:
            self.reader.version = None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        self.reader, self.staging = None, {}
