"""The rollout server's decoder of `POST /update_weights_from_delta` bodies: full weights, or LoRA adapters.

A body is a serialized `factory.core.weights.WeightUpdate`. When it carries whole weights (a full state, or a lossless
delta against the served version) the result is the new state, as before. When every tensor is a LoRA adapter tensor
(`factory.models.lora.adapter_state`: `P.lora_A`, `P.lora_B`, `P.lora_scaling` per adapted module) the decoder keeps
the adapters' own version chain (a delta applies to the adapters of its base version, else `WeightVersionMismatch`,
which the server answers with 409 and the trainer with a full update), and merges them with `AdapterMerger` into
the base weights: those the server held when the first adapter update arrived (it is started from the base model), so
each version is merged from the base, never on top of the last.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from torch import Tensor

from factory.core.weights import WeightUpdate, apply_update
from factory.models.lora import SUFFIXES, AdapterMerger


class UpdateDecoder:
    """One per server (it holds the adapters and the base copy between updates); a `DeltaDecoder`."""

    def __init__(self) -> None:
        self.adapters: dict[str, Tensor] | None = None
        self.version: int | None = None
        self.merger: AdapterMerger | None = None
        self._lock = threading.Lock()  # the server applies one update at a time; this keeps the decoder honest too

    def __call__(self, payload: bytes, current: Mapping[str, Tensor],
                 current_version: int) -> tuple[Mapping[str, Tensor], int | None]:
        update = WeightUpdate.from_bytes(payload)
        if not update.tensors or not all(t.name.endswith(SUFFIXES) for t in update.tensors):
            return apply_update(dict(current), update, current_version), update.version
        with self._lock:
            adapters = apply_update(self.adapters if update.encoding == "delta" else None, update,
                                    self.version if update.encoding == "delta" else None)
            if self.merger is None:
                modules = {t.name.rsplit(".", 1)[0] for t in update.tensors}
                self.merger = AdapterMerger({f"{m}.weight": current[f"{m}.weight"] for m in modules
                                             if f"{m}.weight" in current})
            merged = self.merger.merge(adapters)
            self.adapters, self.version = adapters, update.version
        return {**current, **merged}, update.version
