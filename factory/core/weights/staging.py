"""Host snapshots of a state for the codec, in buffers kept between versions (`HostStaging`).

A version that leaves the device for the codec (a rollout server in another process, a shared dir, another host)
is first copied to host memory. Allocating a fresh pinned buffer per tensor and waiting on each copy made that a
sync per tensor and a pinned allocation per tensor per version; here each storage gets one host buffer (pinned when
its tensor lives on a GPU), reused by every later version, every copy is queued without waiting, and one sync per
device ends the snapshot. Tied tensors (the embedding and the LM head) are copied once and stay one tensor in the
snapshot, so the codec's `_aliases` sends them once. Floating tensors are cast to `dtype` (the dtype the receiver
serves) on their own device before they cross, so bf16 moves half fp32's bytes.

Two sets of buffers alternate: the snapshot before (the base a delta is encoded against) stays intact while the
next is written. A caller names the snapshot it still holds (`keep`), and the other set is written.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from factory.core.weights.codec import storage_key

SLOTS = 2


class HostStaging:
    """Reusable host buffers for snapshots of one state's layout (see the module docstring)."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self._slots: list[dict[str, torch.Tensor]] = [{} for _ in range(SLOTS)]
        self._next = 0
        self.allocations = 0  # host buffers allocated so far (they stop growing once the layout is seen)

    def snapshot(self, state: Mapping[str, torch.Tensor],
                 keep: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A host copy of `state` (tied tensors tied, floating ones in `dtype`), in the set of buffers that does
        not hold `keep` (an earlier snapshot the caller still needs); without `keep`, the two sets alternate. The
        result is valid until a later call writes its set."""
        slot = self._pick(keep)
        bufs = self._slots[slot]
        out: dict[str, torch.Tensor] = {}
        first: dict[tuple, str] = {}
        devices: set[torch.device] = set()
        with torch.no_grad():
            for name, t in state.items():
                owner = first.setdefault(storage_key(t), name)
                if owner != name:
                    out[name] = out[owner]  # tied: one buffer, one copy
                    continue
                t = t.detach()
                dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
                buf = bufs.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != dtype or buf.is_pinned() != _on_gpu(t):
                    buf = bufs[name] = torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=_on_gpu(t))
                    self.allocations += 1
                if _on_gpu(t):
                    # cast on the device (the bytes that cross are the narrow ones), then an async copy to pinned
                    buf.copy_(t if t.dtype == dtype else t.to(dtype), non_blocking=True)
                    devices.add(t.device)
                else:
                    buf.copy_(t)
                out[name] = buf
        for d in devices:  # one wait per device, after every copy is queued
            torch.cuda.current_stream(d).synchronize()
        for name in [n for n in bufs if n not in out]:  # tensors gone from the layout
            del bufs[name]
        self._next = (slot + 1) % SLOTS
        return out

    def _pick(self, keep: Mapping[str, torch.Tensor] | None) -> int:
        if keep:
            held = {t.data_ptr() for t in keep.values()}
            for i in (self._next, *(j for j in range(SLOTS) if j != self._next)):
                if not any(b.data_ptr() in held for b in self._slots[i].values()):
                    return i
            raise RuntimeError("HostStaging: every set of buffers holds a snapshot the caller keeps")
        return self._next


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"
