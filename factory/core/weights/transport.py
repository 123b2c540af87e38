"""Publishing versions: `WeightPublisher` / `WeightSubscriber` over a `Transport` (one per medium).

The stream of updates is like a video stream: a full update now and then (the first, every
`full_every` versions, and on a subscriber's request), deltas in between, each delta against the
version published just before it. A subscriber that fell behind replays the deltas it missed, or
starts again from the newest full one; the media keep enough history for that.

`WeightPublisher(dtype=torch.bfloat16)` publishes floating tensors in the dtype the receiver serves:
cast on the trainer's device before the copy leaves it, half the bytes of fp32, and deltas between
bf16 versions repeat more bits, so they compress better. The host copies land in buffers kept between
versions (`staging.py`: pinned from a GPU, one sync per publish, tied tensors copied once).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch

from factory.core.weights.codec import (
    StateDict,
    WeightSyncError,
    WeightSyncTimeout,
    WeightUpdate,
    apply_update,
    encode_delta,
    encode_full,
    state_layout_digest,
)
from factory.core.weights.staging import HostStaging

MakeUpdate = Callable[[bool], WeightUpdate]  # force_full -> the update to send


class Transport(ABC):
    """One medium. The publisher side calls `send`; each subscriber calls `receive`."""

    @abstractmethod
    def describe(self) -> str:
        """The medium in words, for error messages ("shared dir /x")."""

    @abstractmethod
    def send(self, version: int, make_update: MakeUpdate, timeout: float) -> WeightUpdate:
        """Publish `version`. The transport calls `make_update(force_full)`, with force_full=True when a
        subscriber asked for a full resync or cannot take a delta; returns what was sent."""

    @abstractmethod
    def receive(self, subscriber: str, have: int | None, timeout: float, want_full: bool = False) -> list[WeightUpdate]:
        """Block (at most `timeout` s) until a version newer than `have` exists; return the updates that
        take a state at `have` to the newest version (oldest first; starts with a full one when no
        chain of deltas reaches). want_full: ask the publisher for a fresh full update and wait for it."""

    def note_state(self, layout: str) -> None:  # noqa: B027 - optional hook
        """The layout digest (names/dtypes/shapes) of the state this end now holds; media that
        negotiate full vs delta with the other side (torch.distributed) use it."""


# ---------------------------------------------------------------------------------------------
# chains of updates, shared by the in-process and shared-dir media


def plan_chain(available: dict[int, int | None], have: int | None) -> list[int] | None:
    """Versions to apply, oldest first, to go from `have` to the newest available version.

    `available` maps version -> base version (None for full updates). Each version has one update,
    so the chain is unique: walk back from the newest until reaching `have` or a full update.
    Returns [] when nothing is newer, None when the history needed is gone."""
    if not available:
        return []  # nothing published yet
    cur = max(available)
    if have is not None and have >= cur:
        return []
    chain: list[int] = []
    while True:
        chain.append(cur)
        base = available[cur]
        if base is None or base == have:
            return chain[::-1]
        if base not in available or (have is not None and base < have):
            return None
        cur = base


def gc_versions(available: dict[int, int | None], keep: int) -> list[int]:
    """Versions that can go: not among the last `keep` and older than the newest full update
    (so a subscriber joining late can always start from that full one)."""
    ranked = sorted(available)
    newest_full = max((v for v, b in available.items() if b is None), default=None)
    if newest_full is None:
        return []
    # `keep` counts versions, not version numbers (numbers may skip, e.g. version = trainer step).
    kept = set(ranked[-max(keep, 1):])
    return [v for v in ranked if v < newest_full and v not in kept]


class InProcessTransport(Transport):
    """Publisher and subscribers in one process (threads). Updates stay Python objects."""

    def __init__(self, keep: int = 4, name: str = "in-process channel") -> None:
        self.keep, self.name = keep, name
        self._cond = threading.Condition()
        self._updates: dict[int, WeightUpdate] = {}
        self._resync: set[str] = set()

    def describe(self) -> str:
        return self.name

    def send(self, version: int, make_update: MakeUpdate, timeout: float) -> WeightUpdate:
        with self._cond:
            latest = max(self._updates, default=None)
            if latest is not None and version <= latest:
                raise WeightSyncError(f"publisher: version {version} is not newer than v{latest} on {self.name}")
            force, self._resync = bool(self._resync), set()
        update = make_update(force)
        with self._cond:
            self._updates[update.version] = update
            for v in gc_versions({v: u.base_version for v, u in self._updates.items()}, self.keep):
                del self._updates[v]
            self._cond.notify_all()
        return update

    def receive(self, subscriber: str, have: int | None, timeout: float, want_full: bool = False) -> list[WeightUpdate]:
        deadline = time.monotonic() + timeout
        with self._cond:
            if want_full:
                self._resync.add(subscriber)
            while True:
                chain = self._chain(have, want_full)
                if chain:
                    self._resync.discard(subscriber)  # served (or a periodic full one came first)
                    return chain
                left = deadline - time.monotonic()
                if left <= 0:
                    latest = max(self._updates, default=None)
                    raise WeightSyncTimeout(
                        f"subscriber {subscriber!r} waited {timeout:.1f}s for "
                        f"{'a full update' if want_full else 'a version'} newer than {have} from the publisher "
                        f"over {self.name}; latest seen: {latest}")
                self._cond.wait(left)

    def _chain(self, have: int | None, want_full: bool) -> list[WeightUpdate] | None:
        avail = {v: u.base_version for v, u in self._updates.items()}
        if want_full:
            fulls = [v for v, b in avail.items() if b is None and (have is None or v > have)]
            if not fulls:
                return None
            avail = {v: b for v, b in avail.items() if v >= max(fulls)}
            have = None
        versions = plan_chain(avail, have)
        if versions is None:
            raise WeightSyncError(f"{self.name}: versions after {have} are gone; ask for a full resync")
        return [self._updates[v] for v in versions]


class SharedDirTransport(Transport):
    """Files in a directory every party can see (a local disk, /dev/shm for shared memory, a shared FS).

    Layout: `v<version>-full.fwu`, `v<version>-delta-<base>.fwu`, each written to a temp file then
    renamed (readers never see half a file); `LATEST` (JSON) points at the newest, renamed likewise;
    `resync-<subscriber>.req` files ask for a full update. Readers poll `LATEST` with a bounded wait.
    The publisher keeps the last `keep` versions and everything from the newest full one on."""

    _NAME = re.compile(r"^v(\d+)-(full|delta-(\d+))\.fwu$")

    def __init__(self, path: str | os.PathLike, keep: int = 4, poll_s: float = 0.02) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.keep, self.poll_s = keep, poll_s

    def describe(self) -> str:
        return f"shared dir {self.path}"

    def _available(self) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for name in os.listdir(self.path):
            m = self._NAME.match(name)
            if m:
                out[int(m[1])] = None if m[3] is None else int(m[3])
        return out

    def _file(self, version: int, base: int | None) -> Path:
        return self.path / (f"v{version:012d}-full.fwu" if base is None else f"v{version:012d}-delta-{base:012d}.fwu")

    def _latest(self) -> int | None:
        try:
            return int(json.loads((self.path / "LATEST").read_text())["version"])
        except FileNotFoundError:
            return None

    def _atomic_write(self, dest: Path, write: Callable) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=self.path)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def send(self, version: int, make_update: MakeUpdate, timeout: float) -> WeightUpdate:
        # Writing a local file does not wait on anyone; `timeout` is not needed on this medium.
        latest = self._latest()
        if latest is not None and version <= latest:
            raise WeightSyncError(f"publisher: version {version} is not newer than v{latest} already in {self.path}")
        requests = list(self.path.glob("resync-*.req"))
        update = make_update(bool(requests))
        self._atomic_write(self._file(update.version, update.base_version), update.write)
        self._atomic_write(self.path / "LATEST", lambda f: f.write(json.dumps(
            {"version": update.version, "base_version": update.base_version, "encoding": update.encoding}).encode()))
        if update.encoding == "full":
            for r in requests:  # served; a request that came after we looked stays for the next version
                r.unlink(missing_ok=True)
        avail = self._available()
        for v in gc_versions(avail, self.keep):
            self._file(v, avail[v]).unlink(missing_ok=True)  # a reader that has it open keeps reading
        return update

    def receive(self, subscriber: str, have: int | None, timeout: float, want_full: bool = False) -> list[WeightUpdate]:
        deadline = time.monotonic() + timeout
        request = self.path / f"resync-{re.sub(r'[^A-Za-z0-9_.-]', '_', subscriber)}.req"
        if want_full:
            request.write_text(json.dumps({"have": have}))
        delay = 0.001
        latest = None
        while True:
            latest = self._latest()
            if latest is not None and (have is None or latest > have):
                avail = self._available()
                if want_full:
                    fulls = [v for v, b in avail.items() if b is None and (have is None or v > have)]
                    avail = {v: b for v, b in avail.items() if fulls and v >= max(fulls)}
                chain = plan_chain(avail, None if want_full else have) if avail else None
                if chain:
                    try:
                        updates = [WeightUpdate.from_bytes(self._file(v, avail[v]).read_bytes()) for v in chain]
                        if want_full:
                            request.unlink(missing_ok=True)  # served (or a periodic full one came first)
                        return updates
                    except FileNotFoundError:
                        pass  # collected between listing and reading: list again
                elif chain is None and not want_full:
                    raise WeightSyncError(f"subscriber {subscriber!r}: versions after {have} are gone from "
                                          f"{self.path}; ask for a full resync")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncTimeout(
                    f"subscriber {subscriber!r} waited {timeout:.1f}s for "
                    f"{'a full update' if want_full else 'a version'} newer than {have} from the publisher over "
                    f"shared dir {self.path}; latest seen: {latest}")
            time.sleep(min(delay, left))  # bounded poll; backs off to poll_s
            delay = min(delay * 2, self.poll_s)


# ---------------------------------------------------------------------------------------------
# the two ends


class WeightPublisher:
    """Numbers and publishes versions of a state dict (the trainer side).

    Keeps a CPU copy of the last published state to encode the next delta against (one extra copy of
    the weights). full_every=N sends a full update every N versions (bounds how much history a
    late subscriber replays and what the shared dir keeps); 0 only on the first and on request.
    dtype: publish floating tensors in this dtype (what the receiver serves); None: as they are."""

    def __init__(self, transport: Transport, full_every: int = 10, dtype: torch.dtype | None = None) -> None:
        self.transport, self.full_every, self.dtype = transport, full_every, dtype
        self.version: int | None = None
        self._prev: dict[str, torch.Tensor] | None = None
        self._since_full = 0
        self.last_update: WeightUpdate | None = None
        self._staging = HostStaging(dtype)

    def publish(self, state: StateDict, version: int, timeout: float = 60.0) -> WeightUpdate:
        """Publish `state` as `version` (greater than the last); full or delta as above. Returns what was sent."""
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} must be greater than the last published v{self.version}")
        # taken now (the trainer may step on while we encode), beside the previous version's, which stays the base
        snapshot = self._staging.snapshot(state, keep=self._prev)

        def make_update(force_full: bool) -> WeightUpdate:
            full = force_full or self._prev is None or (self.full_every > 0 and self._since_full + 1 >= self.full_every)
            if full:
                return encode_full(snapshot, version)
            return encode_delta(self._prev, snapshot, version, self.version)

        update = self.transport.send(version, make_update, timeout)
        self._prev, self.version, self.last_update = snapshot, version, update
        self.transport.note_state(state_layout_digest(snapshot))
        self._since_full = 0 if update.encoding == "full" else self._since_full + 1
        return update


class WeightSubscriber:
    """Follows a publisher (the rollout-engine side): `poll` brings `state` to the newest version.

    Pass `state` (e.g. a model's state_dict) and its `version` to have updates written into those
    tensors in place; otherwise the first update must be a full one."""

    def __init__(self, transport: Transport, name: str = "subscriber", state: StateDict | None = None,
                 version: int | None = None) -> None:
        self.transport, self.name = transport, name
        self.state: dict[str, torch.Tensor] | None = dict(state) if state is not None else None
        self.version = version if state is not None else None
        self.bytes_received = 0

    def poll(self, timeout: float = 60.0) -> int:
        """Wait (at most `timeout` s) for a version newer than ours, apply it; return the new version."""
        return self._apply(self.transport.receive(self.name, self.version, timeout))

    def resync(self, timeout: float = 60.0) -> int:
        """Ask the publisher for a full update (after corruption, or to drop a long delta chain) and apply it."""
        return self._apply(self.transport.receive(self.name, self.version, timeout, want_full=True))

    def _apply(self, chain: list[WeightUpdate]) -> int:
        for update in chain:
            try:
                self.state = apply_update(self.state, update, self.version, inplace=self.state is not None)
            except WeightSyncError:
                # The state may be partly overwritten: only a full update can help now.
                self.version = None
                raise
            self.version = update.version
            self.bytes_received += update.nbytes
            self.transport.note_state(state_layout_digest(self.state))
        assert self.version is not None
        return self.version
