"""`TorchDistTransport`: weight updates broadcast over a torch.distributed process group.

Every rank of the group takes part in every publication (collectives run in lockstep): the
publisher rank calls `WeightPublisher.publish`, every other rank `WeightSubscriber.poll`, once per
version. One publication is three steps, each a collective waited on with a timeout:

1. version exchange (all_gather of a small int64 record per rank: magic, exchange number, role,
   world size, the rank's current version, whether it wants a full update, its layout digest).
   Every rank checks every record, so a rank at another exchange number (collectives out of order),
   a second publisher, or another world size raises on all ranks at once instead of hanging or
   mixing payloads. The publisher sends a full update when any subscriber is not at its last version.
2. header broadcast (version, base, encoding, payload bytes, tensor count, layout digest);
3. payload broadcast in chunks (subscribers allocate from the header).

A timeout raises `WeightSyncTimeout` naming the rank, its role, the step and exchange number it was
waiting in, and the publisher rank. After a timeout the group has a collective in flight and is not
usable: destroy it and start again (the trainer's restart logic does that).

Tested on gloo over CPU (world size 2 over 127.0.0.1). NCCL on GPUs is written for (`device` puts the
collective buffers on the GPU) but has not run, nor have several subscribers per group or groups other than
the default (docs/hardware.md).
"""

from __future__ import annotations

import datetime
import hashlib

import torch
import torch.distributed as dist

from factory.core.weights.codec import WeightSyncError, WeightSyncTimeout, WeightUpdate
from factory.core.weights.transport import MakeUpdate, Transport

_MAGIC = 0x46575331  # "FWS1"
_ROLE_PUB, _ROLE_SUB = 1, 2
_NONE = -1  # "no version" in int64 records
_ENC = {"full": 0, "delta": 1}


def _digest63(hex_digest: str | None) -> int:
    if not hex_digest:
        return 0
    return int.from_bytes(hashlib.sha256(hex_digest.encode()).digest()[:8], "little") & (2**63 - 1)


class TorchDistTransport(Transport):
    """Broadcast from rank `src` of `group` (default group when None) to all other ranks.

    `device`: where collective buffers live ("cpu" for gloo, "cuda" for NCCL). `chunk_bytes` bounds
    each payload broadcast (and the GPU staging buffer). The layout digest of each rank's current
    state is supplied by the ends (see `WeightPublisher`/`WeightSubscriber`) via `set_layout`."""

    def __init__(self, src: int = 0, group: dist.ProcessGroup | None = None, device: str | torch.device = "cpu",
                 chunk_bytes: int = 64 << 20) -> None:
        if not dist.is_initialized():
            raise WeightSyncError("TorchDistTransport needs torch.distributed.init_process_group(..., timeout=...) "
                                  "to have run on every rank")
        self.src, self.group, self.device, self.chunk_bytes = src, group, torch.device(device), chunk_bytes
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.seq = 0  # exchanges this rank took part in
        self.publisher_version: int | None = None  # publisher side: the version subscribers must hold
        self.layout: str | None = None  # sha256 of this rank's current names/dtypes/shapes

    def note_state(self, layout: str) -> None:
        self.layout = layout

    def describe(self) -> str:
        return f"torch.distributed {self.backend} group of {self.world} ranks (publisher rank {self.src})"

    # -- collectives with a timeout ---------------------------------------------------------

    def _wait(self, work: dist.Work, timeout: float, role: str, have: int | None, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as e:
            waiting_on = "all subscriber ranks" if role == "publisher" else f"the publisher (rank {self.src})"
            raise WeightSyncTimeout(
                f"rank {self.rank} ({role}, version {have}) waited {timeout:.1f}s for {waiting_on} in {what} of "
                f"weight-sync exchange #{self.seq} over {self.describe()}; the group is unusable now "
                f"(collective still in flight): {e}") from e

    def _exchange(self, role: int, have: int | None, want_full: bool, timeout: float) -> torch.Tensor:
        """Step 1 on every rank; returns the [world, 7] records after checking them."""
        self.seq += 1
        mine = torch.tensor([_MAGIC, self.seq, role, self.world, _NONE if have is None else have, int(want_full),
                             _digest63(self.layout)], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        role_name = "publisher" if role == _ROLE_PUB else "subscriber"
        self._wait(dist.all_gather(out, mine, group=self.group, async_op=True), timeout, role_name, have,
                   "the version exchange")
        recs = torch.stack(out).cpu()
        problems = []
        for r, rec in enumerate(recs.tolist()):
            if rec[0] != _MAGIC:
                problems.append(f"rank {r} sent no weight-sync record (another collective is running there)")
                continue
            if rec[1] != self.seq:
                problems.append(f"rank {r} is at exchange #{rec[1]}, this rank at #{self.seq} "
                                "(collectives out of order)")
            if rec[3] != self.world:
                problems.append(f"rank {r} has world size {rec[3]}, this rank {self.world}")
            expected = _ROLE_PUB if r == self.src else _ROLE_SUB
            if rec[2] != expected:
                problems.append(f"rank {r} acts as {'publisher' if rec[2] == _ROLE_PUB else 'subscriber'}, expected "
                                f"{'publisher' if expected == _ROLE_PUB else 'subscriber'} (src={self.src})")
        if problems:
            raise WeightSyncError(f"rank {self.rank}: weight-sync exchange #{self.seq} over {self.describe()} "
                                  f"is inconsistent: " + "; ".join(problems))
        return recs

    def _bcast(self, t: torch.Tensor, timeout: float, role: str, have: int | None, what: str) -> None:
        self._wait(dist.broadcast(t, self.src, group=self.group, async_op=True), timeout, role, have, what)

    def _bcast_payload(self, buf: torch.Tensor, timeout: float, role: str, have: int | None) -> None:
        n = buf.numel()
        for start in range(0, n, self.chunk_bytes):
            part = buf[start : start + self.chunk_bytes]
            if self.device.type == "cpu":
                self._bcast(part, timeout, role, have, f"payload bytes {start}..{start + part.numel()} of {n}")
            else:  # stage through the device for NCCL (untested: docs/hardware.md)
                dev = part.to(self.device)
                self._bcast(dev, timeout, role, have, f"payload bytes {start}..{start + part.numel()} of {n}")
                part.copy_(dev.cpu())

    # -- Transport --------------------------------------------------------------------------

    def send(self, version: int, make_update: MakeUpdate, timeout: float) -> WeightUpdate:
        if self.rank != self.src:
            raise WeightSyncError(f"rank {self.rank} called publish, but the publisher is rank {self.src}")
        have = self.publisher_version
        recs = self._exchange(_ROLE_PUB, have, False, timeout).tolist()
        mine, want = _digest63(self.layout), _NONE if have is None else have
        # A subscriber not at our last version, asking for a full one, or holding another layout gets a full.
        stale = [r for r, rec in enumerate(recs) if r != self.src and (rec[4] != want or rec[5] or rec[6] != mine)]
        update = make_update(bool(stale))
        blob = update.to_bytes()
        header = torch.tensor([_MAGIC, self.seq, update.version, _NONE if update.base_version is None else
                               update.base_version, _ENC[update.encoding], len(blob), len(update.tensors),
                               _digest63(update.layout_digest())], dtype=torch.int64, device=self.device)
        self._bcast(header, timeout, "publisher", have, "the header broadcast")
        self._bcast_payload(torch.frombuffer(blob, dtype=torch.uint8), timeout, "publisher", have)
        self.publisher_version = update.version
        return update

    def receive(self, subscriber: str, have: int | None, timeout: float, want_full: bool = False) -> list[WeightUpdate]:
        if self.rank == self.src:
            raise WeightSyncError(f"rank {self.rank} is the publisher (src) and cannot subscribe")
        self._exchange(_ROLE_SUB, have, want_full, timeout)
        header = torch.zeros(8, dtype=torch.int64, device=self.device)
        self._bcast(header, timeout, "subscriber", have, "the header broadcast")
        magic, seq, version, base, enc, nbytes, ntensors, layout = header.cpu().tolist()
        if magic != _MAGIC or seq != self.seq:
            raise WeightSyncError(f"rank {self.rank}: header of exchange #{self.seq} is garbled or from exchange "
                                  f"#{seq} (magic {magic:#x}); collectives are out of order")
        base_version = None if base == _NONE else base
        if enc == _ENC["delta"] and base_version != have:
            raise WeightSyncError(f"rank {self.rank}: publisher sent a delta v{version} against v{base_version}, but "
                                  f"this rank holds v{have}")
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self._bcast_payload(buf, timeout, "subscriber", have)
        update = WeightUpdate.from_bytes(buf.numpy())
        if (update.version, update.base_version, len(update.tensors)) != (version, base_version, ntensors) or \
                _digest63(update.layout_digest()) != layout:
            raise WeightSyncError(f"rank {self.rank}: payload of exchange #{self.seq} does not match its header "
                                  f"(v{update.version} vs v{version}, {len(update.tensors)} vs {ntensors} tensors)")
        return [update]
