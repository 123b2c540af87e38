"""One device-to-host copy per step: a step's packed results (`decode_step.pack`) go into a pinned host buffer with
one non-blocking copy and an event, and the host reads them when it needs them (`Fetch.rows`), while the device runs
on. Two pinned buffers alternate, so step t+1's copy never lands in the buffer the host is still reading for step t
(the overlap keeps at most one step in flight). On the CPU the copy is the tensor itself.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Fetch:
    """A started copy of one step's results."""

    def __init__(self, host: Tensor, event: torch.cuda.Event | None):
        self.host, self.event = host, event

    def rows(self) -> list[list[float]]:
        """The results as host lists (waits for the copy)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class HostCopy:
    """Pinned double buffers for the results of the steps of one engine on `device`."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._buffers: list[Tensor] = [torch.empty(0, dtype=torch.float64)] * 2
        self._turn = 0

    def start(self, packed: Tensor) -> Fetch:
        """Copy `packed` (a [rows, cols] float64 device tensor) to the host without blocking."""
        if not self.cuda:
            return Fetch(packed, None)
        self._turn ^= 1
        n = packed.numel()
        if self._buffers[self._turn].numel() < n:  # grows to the largest step seen; a Fetch keeps its old one
            self._buffers[self._turn] = torch.empty(max(n, 2 * self._buffers[self._turn].numel()),
                                                    dtype=torch.float64, pin_memory=True)
        host = self._buffers[self._turn][:n].view(packed.shape)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Fetch(host, event)
