"""Weight versions through one shared buffer: `SharedWeightsWriter` (the trainer) and `SharedWeightsReader` (an
engine in another process on the same host, or on the same GPU).

The writer lays every tensor of a state dict out once (tied tensors share one range) in one flat buffer of the
serving dtype, twice: two slots, so the newest whole version stays readable while the next one is written. On
the CPU the slots are files in host shared memory (/dev/shm); on CUDA they are device allocations that the reader
maps by CUDA IPC (`torch.multiprocessing.reductions.reduce_tensor`'s arguments, sent as JSON, never a pickle).
Either way a small control block in host shared memory holds, per slot, a seqlock: a sequence number (odd while
the slot is being written) and the version it holds.

    writer = SharedWeightsWriter.create(model.state_dict(), torch.bfloat16, "cuda")   # the trainer
    writer.publish(model.state_dict(), version=1)
    reader = SharedWeightsReader.attach(writer.handle())                               # the engine, once
    reader.read_into(engine_state)   # -> 1 (None: nothing newer than the last read)

Publishing casts and copies into the slot that does not hold the newest whole version, waits for the copy to be
complete (on CUDA: an event), then marks the slot whole with the new version. Reading takes the slot with the
newest whole version, copies it, and checks the slot's sequence number again: had the writer come round to that
slot meanwhile (two publishes during one copy), the copy is thrown away and taken again. So a reader never keeps
a half-written version, and one that fell behind gets the newest whole one; versions strictly increase.
The seqlock relies on 8-byte aligned loads and stores being atomic and ordered as issued (x86-64), and on torch's
copies being complete when they return (on CUDA: a synchronize before the re-check).
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import secrets
import stat
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from factory.core.weights.codec import StateDict, WeightSyncError, WeightSyncTimeout, storage_key
from factory.text import clip

KIND = "factory.shared_weights"
FORMAT = 1
SLOTS = 2
_MAGIC = 0x46414354_53485731  # "FACTSHW1"
# control block (int64 words): magic, layout id, then per slot its sequence number and version
_HEADER = 2
_CONTROL_WORDS = _HEADER + 2 * SLOTS
_NONE = -1  # the version of a slot that never held one
_DTYPES = ("float32", "bfloat16", "float16", "float64")
# this process's writers by layout id: a reader attached in the writer's own process uses its slots directly (CUDA
# cannot open an IPC handle in the process that made it)
_WRITERS: weakref.WeakValueDictionary[int, SharedWeightsWriter] = weakref.WeakValueDictionary()
_IPC_FIELDS = ("size", "stride", "offset", "device_uuid", "handle", "storage_size_bytes", "storage_offset_bytes",
               "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")


class SharedHandleError(WeightSyncError, ValueError):
    """A shared-weights handle (or a state dict held against it) that cannot be used; the message names the field."""


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str  # the dtype the writer's tensor had (the buffer holds the buffer's dtype)
    offset: int  # in elements of the buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _q(value: object) -> str:
    """A value from a handle, quoted short enough for a one-line error."""
    return clip(repr(value), 80)


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _layout(state: StateDict) -> tuple[list[_Entry], int]:
    """Each tensor's range in the flat buffer, tied tensors (the same view of the same memory) sharing one."""
    entries, seen, total = [], {}, 0
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise SharedHandleError(f"state[{name!r}]: the shared buffer holds floating-point weights, got "
                                    f"{getattr(t, 'dtype', type(t).__name__)}")
        key = storage_key(t)
        if key not in seen:
            seen[key] = total
            total += t.numel()
        entries.append(_Entry(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), seen[key]))
    return entries, total


def _check_state(entries: list[_Entry], state: StateDict, who: str) -> None:
    names = [e.name for e in entries]
    if set(state) != set(names):
        missing = [n for n in names if n not in state][:5]
        extra = [n for n in state if n not in set(names)][:5]
        raise SharedHandleError(f"{who}: the state dict does not match the shared layout: missing {missing}, "
                                f"unexpected {extra}")
    for e in entries:
        if tuple(state[e.name].shape) != e.shape:
            raise SharedHandleError(f"{who}: state[{e.name!r}] has shape {tuple(state[e.name].shape)}, the shared "
                                    f"layout {e.shape}")


def _control(path: str, words: int, write: bool) -> np.ndarray:
    return np.memmap(path, dtype=np.int64, mode="r+" if write else "r", shape=(words,))


def _new_file(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode("ascii")


def _cuda_ipc(t: torch.Tensor) -> dict[str, Any]:
    """The JSON-safe arguments of torch's CUDA IPC rebuild of `t` (the device named by UUID: the reader may number
    its GPUs otherwise)."""
    _, args = reduce_tensor(t)
    (_, size, stride, offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset, event_handle,
     event_sync) = args
    return {"size": list(size), "stride": list(stride), "offset": int(offset),
            "device_uuid": str(torch.cuda.get_device_properties(device).uuid), "handle": _b64(handle),
            "storage_size_bytes": int(size_bytes), "storage_offset_bytes": int(offset_bytes),
            "ref_counter_handle": _b64(ref_handle), "ref_counter_offset": int(ref_offset),
            "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync)}


def _on(device: torch.device):
    """The device guard of `device` (a no-op on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _remove(files: list[str], directory: Path | None) -> None:
    for f in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)
    if directory is not None:
        with contextlib.suppress(OSError):
            directory.rmdir()


class SharedWeightsWriter:
    """The trainer's end: two slots of one flat buffer and the control block; `publish` versions into them."""

    def __init__(self, entries: list[_Entry], numel: int, dtype: torch.dtype, device: torch.device,
                 directory: Path, owns_directory: bool):
        self.entries, self.numel, self.dtype, self.device = entries, numel, dtype, device
        self.layout_id = secrets.randbits(62)
        self.version: int | None = None  # the newest whole version
        self._newest: int | None = None  # the slot holding it
        self._dir = directory
        # one copy per storage: the first name of each range, in layout order
        self._unique = list({(e.offset, e.shape): e for e in reversed(entries)}.values())[::-1]
        control = str(directory / "control")
        self._files = [control]
        # the files go with the writer, also one never closed (not with a killed process: /dev/shm keeps them)
        self._finalizer = weakref.finalize(self, _remove, self._files, directory if owns_directory else None)
        _new_file(control, 8 * _CONTROL_WORDS)
        self._ctl = _control(control, _CONTROL_WORDS, write=True)
        self._ctl[0], self._ctl[1] = _MAGIC, self.layout_id
        for s in range(SLOTS):
            self._ctl[_HEADER + 2 * s], self._ctl[_HEADER + 2 * s + 1] = 0, _NONE
        self.slots: list[torch.Tensor] = []
        for s in range(SLOTS):
            if device.type == "cpu":
                path = str(self._dir / f"slot{s}")
                self._files.append(path)
                _new_file(path, numel * dtype.itemsize)
                self.slots.append(torch.from_file(path, shared=True, size=numel, dtype=dtype))
            else:
                self.slots.append(torch.zeros(numel, dtype=dtype, device=device))
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._handle: dict[str, Any] | None = None
        self.closed = False
        _WRITERS[self.layout_id] = self

    @classmethod
    def create(cls, state: StateDict, dtype: torch.dtype, device: str | torch.device,
               path: str | Path | None = None) -> SharedWeightsWriter:
        """A writer for state dicts shaped as `state`, its slots in `dtype` on `device` (cpu: files in `path`, a new
        directory in /dev/shm by default; cuda: device memory, the control block in `path` or /dev/shm)."""
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise SharedHandleError(f"device: expected cpu or cuda, got {device}")
        if str(dtype).removeprefix("torch.") not in _DTYPES:
            raise SharedHandleError(f"dtype: expected one of {', '.join(_DTYPES)}, got {dtype}")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        entries, numel = _layout(state)
        if path is None:
            directory = Path(tempfile.mkdtemp(prefix="factory-shared-", dir=_shm_dir()))
        else:
            directory = Path(path)
            directory.mkdir(parents=True, exist_ok=True)
        # tmpfs takes a file larger than its free room, then kills the process that writes past it (SIGBUS)
        need = SLOTS * numel * dtype.itemsize if device.type == "cpu" else 0
        st = os.statvfs(directory)
        if need > st.f_bavail * st.f_frsize:
            if path is None:
                directory.rmdir()
            raise WeightSyncError(f"the shared weights buffer needs {need >> 20} MiB in {directory}, "
                                  f"{(st.f_bavail * st.f_frsize) >> 20} MiB are free")
        return cls(entries, numel, dtype, device, directory, owns_directory=path is None)

    def _seq(self, slot: int) -> int:
        return _HEADER + 2 * slot

    def publish(self, state: StateDict, version: int) -> None:
        """Cast-copy `state` into the slot not holding the newest whole version, then mark it whole as `version`."""
        if self.closed:
            raise WeightSyncError("publish on a closed SharedWeightsWriter")
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version}: versions strictly increase, the newest is {self.version}")
        _check_state(self.entries, state, "publish")
        slot = 0 if self._newest is None else 1 - self._newest
        seq, buf = self._seq(slot), self.slots[slot]
        self._ctl[seq] += 1  # odd: being written
        try:
            with torch.no_grad(), _on(self.device):
                for e in self._unique:
                    buf[e.offset:e.offset + e.numel].view(e.shape).copy_(state[e.name].detach())
                if self._event is not None:  # the copies are queued on the device's current stream: wait for them
                    self._event.record(torch.cuda.current_stream(self.device))
                    self._event.synchronize()
        except BaseException:
            self._ctl[seq + 1] = _NONE  # the slot holds no version now: readers skip it
            self._ctl[seq] += 1
            raise
        self._ctl[seq + 1] = version
        self._ctl[seq] += 1  # even: whole
        self._newest, self.version = slot, version

    def handle(self) -> dict[str, Any]:
        """What a reader attaches with (JSON-safe): the layout, the control block and where the slots are."""
        if self._handle is None:
            if self.device.type == "cpu":
                slots = [{"path": f} for f in self._files[1:]]
            else:
                slots = [_cuda_ipc(t) for t in self.slots]
            self._handle = {
                "kind": KIND, "format": FORMAT, "id": self.layout_id, "device": self.device.type,
                "dtype": str(self.dtype).removeprefix("torch."), "numel": self.numel, "control": self._files[0],
                "slots": slots,
                "tensors": [{"name": e.name, "shape": list(e.shape), "dtype": e.dtype, "offset": e.offset}
                            for e in self.entries]}
        return self._handle

    def close(self) -> None:
        """Free the slots and remove the files (a reader still attached keeps its mappings until it closes)."""
        if self.closed:
            return
        self.closed = True
        self.slots, self._ctl = [], None  # type: ignore[assignment]
        _WRITERS.pop(self.layout_id, None)
        self._finalizer()

    def __enter__(self) -> SharedWeightsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- the reader's end
def _field(handle: Mapping, name: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    if name not in handle:
        raise SharedHandleError(f"shared weights handle: field '{where}{name}' is missing")
    value = handle[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise SharedHandleError(f"shared weights handle: field '{where}{name}': expected {want}, got "
                                f"{type(value).__name__}")
    return value


def _count(handle: Mapping, name: str, where: str = "", least: int = 0) -> int:
    value = _field(handle, name, int, where)
    if value < least:
        raise SharedHandleError(f"shared weights handle: field '{where}{name}': expected an integer >= {least}, "
                                f"got {value}")
    return value


def _regular_file(path: str, field: str, nbytes: int) -> str:
    try:
        st = os.stat(path, follow_symlinks=False)
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or e
        raise SharedHandleError(f"shared weights handle: field {field!r}: cannot open {_q(path)}: {why}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SharedHandleError(f"shared weights handle: field {field!r}: {_q(path)} is not a regular file")
    if st.st_size != nbytes:
        raise SharedHandleError(f"shared weights handle: field {field!r}: {_q(path)} has {st.st_size} bytes, the "
                                f"layout needs {nbytes}")
    return path


def _unb64(handle: Mapping, name: str, where: str, optional: bool = False) -> bytes | None:
    value = handle.get(name) if optional else _field(handle, name, str, where)
    if value is None:
        return None
    if not isinstance(value, str):
        raise SharedHandleError(f"shared weights handle: field '{where}{name}': expected base64 text or null")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise SharedHandleError(f"shared weights handle: field '{where}{name}': not base64") from None


def _local_cuda_index(uuid: str, where: str) -> int:
    if not torch.cuda.is_available():
        raise SharedHandleError(f"shared weights handle: field '{where}device_uuid': the buffers are on a GPU and "
                                f"this process sees none")
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise SharedHandleError(f"shared weights handle: field '{where}device_uuid': no visible GPU has UUID {_q(uuid)}")


def _open_cuda_slot(spec: Mapping, where: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    for name in _IPC_FIELDS:
        if name not in spec:
            raise SharedHandleError(f"shared weights handle: field '{where}{name}' is missing")
    size = _field(spec, "size", list, where)
    if size != [numel]:
        raise SharedHandleError(f"shared weights handle: field '{where}size': expected [{numel}], got {_q(size)}")
    if _field(spec, "stride", list, where) != [1]:
        raise SharedHandleError(f"shared weights handle: field '{where}stride': expected [1]")
    args = [_count(spec, n, where) for n in ("offset", "storage_size_bytes", "storage_offset_bytes",
                                              "ref_counter_offset")]
    if args[1] < (args[0] + numel) * dtype.itemsize:
        raise SharedHandleError(f"shared weights handle: field '{where}storage_size_bytes': {args[1]} bytes cannot "
                                f"hold {numel} {dtype} elements at offset {args[0]}")
    handle = _unb64(spec, "handle", where)
    ref = _unb64(spec, "ref_counter_handle", where)
    event = _unb64(spec, "event_handle", where, optional=True)
    sync = _field(spec, "event_sync_required", bool, where)
    index = _local_cuda_index(_field(spec, "device_uuid", str, where), where)  # the last: every field is checked
    try:
        return rebuild_cuda_tensor(torch.Tensor, torch.Size([numel]), (1,), args[0], torch.storage.TypedStorage,
                                   dtype, index, handle, args[1], args[2], False, ref, args[3], event, sync)
    except RuntimeError as e:
        raise SharedHandleError(f"shared weights handle: field '{where}handle': CUDA could not open it: {e}") from None


class SharedWeightsReader:
    """An engine's end: attached once by the writer's handle; `read_into` copies the newest whole version."""

    def __init__(self, entries: list[_Entry], numel: int, dtype: torch.dtype, control: np.ndarray,
                 slots: list[torch.Tensor], layout_id: int):
        self.entries, self.numel, self.dtype, self.layout_id = entries, numel, dtype, layout_id
        self._ctl, self.slots = control, slots
        self.version: int | None = None  # the version read last
        self.retries = 0  # copies thrown away because the writer came round to the slot meanwhile
        self.closed = False

    @classmethod
    def attach(cls, handle: Mapping[str, Any]) -> SharedWeightsReader:
        """Check every field of `handle` (a `SharedWeightsWriter.handle()`, e.g. received as JSON) and map its
        buffers; a bad field raises `SharedHandleError` naming it."""
        if not isinstance(handle, Mapping):
            raise SharedHandleError(f"shared weights handle: expected a JSON object, got {type(handle).__name__}")
        if _field(handle, "kind", str) != KIND:
            raise SharedHandleError(f"shared weights handle: field 'kind': expected {KIND!r}, got {_q(handle['kind'])}")
        if _field(handle, "format", int) != FORMAT:
            raise SharedHandleError(f"shared weights handle: field 'format': expected {FORMAT}, got "
                                    f"{_q(handle['format'])}")
        layout_id = _count(handle, "id")
        device = _field(handle, "device", str)
        if device not in ("cpu", "cuda"):
            raise SharedHandleError(f"shared weights handle: field 'device': expected 'cpu' or 'cuda', got "
                                    f"{_q(device)}")
        dtype_name = _field(handle, "dtype", str)
        if dtype_name not in _DTYPES:
            raise SharedHandleError(f"shared weights handle: field 'dtype': expected one of {', '.join(_DTYPES)}, "
                                    f"got {_q(dtype_name)}")
        dtype = getattr(torch, dtype_name)
        numel = _count(handle, "numel", least=1)
        entries = cls._entries(_field(handle, "tensors", list), numel)
        slots_spec = _field(handle, "slots", list)
        if len(slots_spec) != SLOTS:
            raise SharedHandleError(f"shared weights handle: field 'slots': expected {SLOTS} slots, got "
                                    f"{len(slots_spec)}")
        control_path = _regular_file(_field(handle, "control", str), "control", 8 * _CONTROL_WORDS)
        control = _control(control_path, _CONTROL_WORDS, write=False)
        if int(control[0]) != _MAGIC or int(control[1]) != layout_id:
            raise SharedHandleError(f"shared weights handle: field 'control': {control_path!r} is not the control "
                                    f"block of shared weights {layout_id}")
        slots = []
        for s, spec in enumerate(slots_spec):
            where = f"slots[{s}]."
            if not isinstance(spec, Mapping):
                raise SharedHandleError(f"shared weights handle: field 'slots[{s}]': expected an object")
            if device == "cpu":
                path = _regular_file(_field(spec, "path", str, where), f"slots[{s}].path", numel * dtype.itemsize)
                slots.append(torch.from_file(path, shared=True, size=numel, dtype=dtype))
            elif (local := _WRITERS.get(layout_id)) is not None and local.device.type == "cuda" \
                    and (local.numel, local.dtype) == (numel, dtype):
                slots.append(local.slots[s])
            else:
                slots.append(_open_cuda_slot(spec, where, dtype, numel))
        return cls(entries, numel, dtype, control, slots, layout_id)

    @staticmethod
    def _entries(tensors: list, numel: int) -> list[_Entry]:
        entries, names = [], set()
        for i, t in enumerate(tensors):
            where = f"tensors[{i}]."
            if not isinstance(t, Mapping):
                raise SharedHandleError(f"shared weights handle: field 'tensors[{i}]': expected an object")
            name = _field(t, "name", str, where)
            if name in names:
                raise SharedHandleError(f"shared weights handle: field '{where}name': {_q(name)} appears twice")
            names.add(name)
            shape = _field(t, "shape", list, where)
            if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
                raise SharedHandleError(f"shared weights handle: field '{where}shape': expected non-negative "
                                        f"integers, got {_q(shape)}")
            dtype = _field(t, "dtype", str, where)
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise SharedHandleError(f"shared weights handle: field '{where}dtype': unknown dtype {_q(dtype)}")
            offset = _count(t, "offset", where)
            entry = _Entry(name, tuple(shape), dtype, offset)
            if offset + entry.numel > numel:
                raise SharedHandleError(f"shared weights handle: field '{where}offset': {_q(name)} ({entry.numel} "
                                        f"elements at {offset}) runs past the buffer's {numel}")
            entries.append(entry)
        if not entries:
            raise SharedHandleError("shared weights handle: field 'tensors': no tensors")
        return entries

    def _newest(self) -> tuple[int, int, int] | None:
        """(slot, its sequence number, its version) of the newest whole version, None if there is none yet."""
        best = None
        for s in range(SLOTS):
            seq = int(self._ctl[_HEADER + 2 * s])
            version = int(self._ctl[_HEADER + 2 * s + 1])
            if seq % 2 == 0 and version != _NONE and (best is None or version > best[2]):
                best = (s, seq, version)
        return best

    def available(self) -> int | None:
        """The newest whole version in the buffer (None: none yet), without copying it."""
        newest = self._newest()
        return None if newest is None else newest[2]

    def _copy(self, slot: int, state: StateDict) -> None:
        """Copy slot `slot` into `state` (tied destinations once); complete when it returns."""
        buf, done = self.slots[slot], set()
        with torch.no_grad():
            for e in self.entries:
                dst = state[e.name]
                key = storage_key(dst)
                if key in done:
                    continue
                done.add(key)
                dst.copy_(buf[e.offset:e.offset + e.numel].view(e.shape))
        for device in {t.device for t in (buf, *state.values()) if t.is_cuda}:  # done before the seqlock re-check
            torch.cuda.synchronize(device)

    def read_into(self, state: StateDict, timeout: float = 60.0) -> int | None:
        """Copy the newest whole version into `state`'s tensors (in place, in their dtype) and return it; None if
        nothing is newer than what this reader read last. A copy the writer overtook is taken again, up to
        `timeout` seconds (then `WeightSyncTimeout`)."""
        if self.closed:
            raise WeightSyncError("read_into on a closed SharedWeightsReader")
        _check_state(self.entries, state, "read_into")
        deadline = time.monotonic() + timeout
        while True:
            newest = self._newest()
            if newest is None or (self.version is not None and newest[2] <= self.version):
                return None
            slot, seq, version = newest
            self._copy(slot, state)
            if int(self._ctl[_HEADER + 2 * slot]) == seq:  # the writer did not touch the slot during the copy
                self.version = version
                return version
            self.retries += 1
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(f"shared weights: the writer overwrote the slot during each copy for "
                                        f"{timeout:g} s ({self.retries} copies thrown away); last wanted version "
                                        f"{version}")

    def close(self) -> None:
        self.closed = True
        self.slots, self._ctl = [], None  # type: ignore[assignment]

    def __enter__(self) -> SharedWeightsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
