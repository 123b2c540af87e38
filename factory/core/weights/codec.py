"""Encodings of one weight version: `WeightUpdate`, `encode_full`, `encode_delta`, `apply_update`.

Everything works on the raw bits of each tensor (an unsigned-integer view of the same width), so a
reconstruction is bit-identical by construction: bf16/fp16/fp32/int tensors, NaN payloads, -0.0.
Why the delta is coded the way it is (sparse gaps + zigzag differences, byte planes, zstd level 1)
is explained in the package docstring (`factory/core/weights/__init__.py`); docs/results.md has the figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import BinaryIO, Literal, TypeVar

import numpy as np
import torch
import zstandard

Encoding = Literal["full", "delta"]
StateDict = Mapping[str, torch.Tensor]

# Per-tensor schemes inside an update:
#   raw    - the tensor's bytes (full updates; new tensors or a dtype/shape change in a delta)
#   same   - unchanged since the base: no payload, the checksum still covers it
#   sparse - gaps between changed elements + zigzag(new - old) at those elements, byte planes, zstd
#   dense  - zigzag(new - old) for every element, byte planes, zstd
#   alias  - the same tensor as entry info["index"] of this update (tied weights, e.g. embeddings
#            and LM head): sent once, and still one tensor after apply
SCHEMES = ("raw", "same", "sparse", "dense", "alias")
# Above this fraction of changed elements the index stream stops paying for itself (measured:
# sparse is smaller up to ~35% changed, equal near 60%, and slower from there on).
DENSE_ABOVE = 0.5
ZSTD_LEVEL = 1  # measured: level 1 is as small as 3-9 on these streams and the fastest
_DENSE_THREADS_ABOVE = 16 << 20  # multithreaded zstd only pays on large inputs
# Threads that encode/apply tensors side by side; more cores help on bigger hosts.
WORKERS = min(8, os.cpu_count() or 1)
T = TypeVar("T")
R = TypeVar("R")
# "Factory Weight UPDate", format 1: magic, u64 header size, zstd(JSON header), payloads in header order.
_MAGIC = b"FWUPD\x00\x01\x00"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class WeightSyncError(RuntimeError):
    """Base class of weight-sync failures."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A blocking weight-sync operation ran past its timeout; the message says who waited on what."""


class WeightVersionMismatch(WeightSyncError):
    """A delta was applied to a state of another version than its base."""


class WeightChecksumError(WeightSyncError):
    """A reconstructed tensor does not hash to the published checksum, or a payload is corrupt."""


@dataclass
class TensorPayload:
    """One tensor of an update: what it must become (dtype, shape, checksum) and how it is coded."""

    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    scheme: str  # one of SCHEMES
    checksum: str  # sha256 hex of the reconstructed tensor's raw bytes
    data: bytes | memoryview = b""
    info: dict[str, int] = field(default_factory=dict)  # scheme parameters (counts, split offsets)


@dataclass
class WeightUpdate:
    """One published version: a full state, or a lossless delta against `base_version`."""

    version: int
    base_version: int | None  # None for a full update
    encoding: Encoding
    tensors: list[TensorPayload]

    @property
    def payload_bytes(self) -> int:
        return sum(len(t.data) for t in self.tensors)

    @property
    def nbytes(self) -> int:
        """Size of the serialized update (what crosses the wire or lands on disk)."""
        return len(_MAGIC) + 8 + len(self._header()) + self.payload_bytes

    def layout_digest(self) -> str:
        """sha256 over the target's names, dtypes and shapes (not values)."""
        return layout_digest({t.name: (t.dtype, t.shape) for t in self.tensors})

    def _header(self) -> bytes:
        tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "scheme": t.scheme,
                    "checksum": t.checksum, "nbytes": len(t.data), "info": t.info} for t in self.tensors]
        head = json.dumps({"version": self.version, "base_version": self.base_version, "encoding": self.encoding,
                           "tensors": tensors}, separators=(",", ":")).encode()
        # Compressed: names and keys repeat; on the tiny model the plain header was 21% of a delta.
        return zstandard.ZstdCompressor(level=3).compress(head)

    def write(self, f: BinaryIO) -> int:
        """Stream the serialized update to a binary file; returns the bytes written."""
        header = self._header()
        f.write(_MAGIC + struct.pack("<Q", len(header)) + header)
        for t in self.tensors:
            f.write(t.data)
        return len(_MAGIC) + 8 + len(header) + self.payload_bytes

    def to_bytes(self) -> bytearray:
        """The serialized update (a bytearray, so torch.frombuffer can share it without a copy)."""
        header = self._header()
        out = bytearray(len(_MAGIC) + 8 + len(header) + self.payload_bytes)
        out[: len(_MAGIC) + 8] = _MAGIC + struct.pack("<Q", len(header))
        pos = len(_MAGIC) + 8
        out[pos : pos + len(header)] = header
        pos += len(header)
        for t in self.tensors:
            out[pos : pos + len(t.data)] = t.data
            pos += len(t.data)
        return out

    @classmethod
    def from_bytes(cls, buf: bytes | bytearray | memoryview) -> WeightUpdate:
        """Parse a serialized update; payloads are zero-copy views into `buf`."""
        mv = memoryview(buf).cast("B")
        if len(mv) < len(_MAGIC) + 8 or bytes(mv[: len(_MAGIC)]) != _MAGIC:
            raise WeightSyncError(f"not a weight update (bad magic; {len(mv)} bytes)")
        (hlen,) = struct.unpack("<Q", mv[len(_MAGIC) : len(_MAGIC) + 8])
        pos = len(_MAGIC) + 8
        try:
            h = json.loads(zstandard.ZstdDecompressor().decompress(mv[pos : pos + hlen], max_output_size=1 << 30))
        except (ValueError, zstandard.ZstdError) as e:
            raise WeightSyncError(f"weight update header is corrupt: {e}") from e
        pos += hlen
        tensors = []
        for t in h["tensors"]:
            n = t["nbytes"]
            if pos + n > len(mv):
                raise WeightSyncError(f"weight update v{h['version']} is truncated at tensor {t['name']!r}: "
                                      f"needs {pos + n} bytes, has {len(mv)}")
            tensors.append(TensorPayload(t["name"], t["dtype"], tuple(t["shape"]), t["scheme"], t["checksum"],
                                         mv[pos : pos + n], t["info"]))
            pos += n
        return cls(h["version"], h["base_version"], h["encoding"], tensors)


# ---------------------------------------------------------------------------------------------
# helpers on raw bits


def _flat_bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of the same width (a view when t is CPU-contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().view(_UINT[t.element_size()])


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of the raw bytes (sha256 is hardware-accelerated on x86/ARM: about 2 GB/s with SHA-NI)."""
    return hashlib.sha256(_flat_bits(t)).hexdigest()


def layout_digest(layout: Mapping[str, tuple[str, tuple[int, ...]]]) -> str:
    h = hashlib.sha256()
    for name in sorted(layout):
        dtype, shape = layout[name]
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\n".encode())
    return h.hexdigest()


def state_layout_digest(state: StateDict) -> str:
    return layout_digest({k: (_dtype_name(v.dtype), tuple(v.shape)) for k, v in state.items()})


def storage_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same view of the same memory (tied weights)."""
    if t.numel() == 0:
        return ("empty", id(t))  # every empty tensor has data_ptr 0: never tie them
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r} in weight update")
    return dt


def _planes(a: np.ndarray) -> np.ndarray:
    """Byte-plane shuffle: all first bytes, then all second bytes, ... (high planes of small numbers
    are runs of zeros, which zstd then all but removes)."""
    k = a.dtype.itemsize
    return a.view(np.uint8).reshape(-1, k).T.copy() if k > 1 else a


def _unplanes(b: bytes | memoryview, dtype: type[np.unsignedinteger]) -> np.ndarray:
    k = np.dtype(dtype).itemsize
    u8 = np.frombuffer(b, dtype=np.uint8)
    return u8.reshape(k, -1).T.copy().view(dtype).reshape(-1) if k > 1 else u8


def _parallel(fn: Callable[[T], R], items: list[T]) -> list[R]:
    """Map over tensors on a few threads (hashing, numpy and zstd all release the GIL), in order."""
    if len(items) <= 1 or WORKERS <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="weights") as pool:
        return list(pool.map(fn, items))


def _zigzag(d: np.ndarray) -> np.ndarray:
    """Map a wrapped unsigned difference to small numbers for small |difference|: 0,-1,1,-2 -> 0,1,2,3.
    All arithmetic is unsigned, so wrap-around is well defined (signed overflow is not, in C)."""
    sign = d >> (8 * d.dtype.itemsize - 1)
    return (d << 1) ^ (np.zeros_like(d) - sign)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    return (z >> 1) ^ (np.zeros_like(z) - (z & 1))


def _compress(a: np.ndarray) -> bytes:
    threads = 2 if a.nbytes > _DENSE_THREADS_ABOVE else 0
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=threads, write_checksum=True).compress(a)


def _decompress(b: bytes | memoryview, nbytes: int, what: str) -> bytes:
    try:
        out = zstandard.ZstdDecompressor().decompress(b, max_output_size=nbytes)
    except zstandard.ZstdError as e:
        raise WeightChecksumError(f"{what}: compressed payload is corrupt ({e})") from e
    if len(out) != nbytes:
        raise WeightChecksumError(f"{what}: payload decompressed to {len(out)} bytes, expected {nbytes}")
    return out


# ---------------------------------------------------------------------------------------------
# encoders


def _aliases(state: StateDict) -> dict[str, str]:
    """name -> the first earlier name whose tensor is the very same memory."""
    first: dict[tuple, str] = {}
    out = {}
    for name, t in state.items():
        owner = first.setdefault(storage_key(t), name)
        if owner != name:
            out[name] = owner
    return out


def _encode(state: StateDict, code: Callable[[str, torch.Tensor], TensorPayload]) -> list[TensorPayload]:
    """Code every tensor (on threads), tied ones once: the others become `alias` entries."""
    alias_of = _aliases(state)
    primaries = [(k, v) for k, v in state.items() if k not in alias_of]
    coded = dict(zip([k for k, _ in primaries], _parallel(lambda kv: code(*kv), primaries), strict=True))
    index = {k: i for i, k in enumerate(state)}
    out = []
    for name in state:
        if name in alias_of:
            src = coded[alias_of[name]]
            out.append(TensorPayload(name, src.dtype, src.shape, "alias", src.checksum, b"",
                                     {"index": index[alias_of[name]]}))
        else:
            out.append(coded[name])
    return out


def _raw_payload(name: str, t: torch.Tensor) -> TensorPayload:
    bits = _flat_bits(t)
    # a private copy as a numpy array, not `tobytes()`: numpy's large allocations take fewer page faults than a
    # bytes object's (docs/results.md, issue 34: encode_full of 384 MB in bf16, 0.70 -> 0.59 s)
    return TensorPayload(name, _dtype_name(t.dtype), tuple(t.shape), "raw", hashlib.sha256(bits).hexdigest(),
                         memoryview(bits.copy()).cast("B"))


def encode_full(state: StateDict, version: int) -> WeightUpdate:
    """Every tensor's raw bytes (copied: the caller may keep training on its tensors)."""
    return WeightUpdate(int(version), None, "full", _encode(state, _raw_payload))


def _delta_payload(name: str, old: torch.Tensor, new: torch.Tensor) -> TensorPayload:
    # numpy, not torch: on these element-wise passes numpy's SIMD loops were 3-8x faster here
    # (ne 1.6 ms vs 9.4 ms, flatnonzero 3 ms vs 17 ms per 11.5M elements), and they drop the GIL,
    # so tensors encode in parallel threads.
    p, q = _flat_bits(old), _flat_bits(new)
    checksum = hashlib.sha256(q).hexdigest()
    meta = (name, _dtype_name(new.dtype), tuple(new.shape))
    changed_mask = p != q
    changed = int(np.count_nonzero(changed_mask))
    if changed == 0:
        return TensorPayload(*meta, "same", checksum)
    if changed > DENSE_ABOVE * q.size:
        del changed_mask
        return TensorPayload(*meta, "dense", checksum, _compress(_planes(_zigzag(q - p))))
    idx = np.flatnonzero(changed_mask)
    del changed_mask
    gap_type = np.uint64 if q.size >= 2**31 else np.uint32
    gaps = np.diff(idx, prepend=-1).astype(gap_type)
    z_gaps = _compress(_planes(gaps))
    z_vals = _compress(_planes(_zigzag(q[idx] - p[idx])))
    return TensorPayload(*meta, "sparse", checksum, z_gaps + z_vals,
                         {"count": changed, "gaps_nbytes": len(z_gaps), "gap_width": np.dtype(gap_type).itemsize})


def encode_delta(prev: StateDict, new: StateDict, version: int, base_version: int) -> WeightUpdate:
    """What changed from `prev` (published as `base_version`) to `new`, losslessly.

    Tensors whose dtype or shape changed, or that are new, travel raw; tensors missing from `new`
    are dropped on apply. Every tensor carries the sha256 of its new bytes."""
    if int(version) <= int(base_version):
        raise ValueError(f"delta version {version} must be greater than its base version {base_version}")

    def one(name: str, t: torch.Tensor) -> TensorPayload:
        old = prev.get(name)
        if old is None or old.dtype != t.dtype or old.shape != t.shape:
            return _raw_payload(name, t)
        return _delta_payload(name, old, t)

    return WeightUpdate(int(version), int(base_version), "delta", _encode(new, one))


# ---------------------------------------------------------------------------------------------
# apply


def apply_update(
    state: StateDict | None, update: WeightUpdate, state_version: int | None = None, *, inplace: bool = False
) -> dict[str, torch.Tensor]:
    """The state at `update.version`, reconstructed from `state` (at `state_version`) and verified.

    A full update needs no state. A delta needs the state of exactly its base version, else
    `WeightVersionMismatch`. Every tensor is checked against its sha256: a corrupt payload or a base
    whose contents differ from what the publisher had raises `WeightChecksumError`.

    With `inplace=True` tensors of unchanged dtype/shape are overwritten in `state` (no second copy
    of the weights; a model whose parameters are those tensors sees the new version). If it raises
    midway, `state` is partly updated: throw it away and resync from a full update.
    Otherwise `state` is left untouched and the result holds fresh tensors."""
    if update.encoding == "delta":
        if state is None or state_version is None:
            raise WeightVersionMismatch(
                f"delta v{update.version} needs the state of base v{update.base_version}, but "
                f"{'no state' if state is None else 'a state of unknown version'} was given")
        if state_version != update.base_version:
            raise WeightVersionMismatch(
                f"delta v{update.version} is against base v{update.base_version}, but the state given is "
                f"v{state_version}; apply the missing versions in order or resync from a full update")
    elif update.encoding != "full":
        raise WeightSyncError(f"unknown encoding {update.encoding!r} in update v{update.version}")

    # Entries that share a result with an earlier one: `alias` entries, and (in place) entries whose
    # base tensor is the same memory as an earlier entry's (tied in this state): decoding those
    # again would apply the change twice.
    shared: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for i, tp in enumerate(update.tensors):
        if tp.scheme == "alias":
            j = tp.info.get("index", -1)
            if not 0 <= j < i or update.tensors[j].scheme == "alias":
                raise WeightSyncError(f"tensor {tp.name!r} of update v{update.version}: bad alias index {j}")
            shared[tp.name] = update.tensors[j].name
        elif inplace and state is not None and tp.name in state:
            owner = seen.setdefault(storage_key(state[tp.name]), tp.name)
            if owner != tp.name:
                shared[tp.name] = owner
    by_name = {tp.name: tp for tp in update.tensors}
    primaries = [tp for tp in update.tensors if tp.name not in shared]

    def one(tp: TensorPayload) -> torch.Tensor:
        return _apply_tensor(tp, state.get(tp.name) if state is not None else None, update, inplace)

    done = dict(zip([tp.name for tp in primaries], _parallel(one, primaries), strict=True))
    out: dict[str, torch.Tensor] = {}
    for tp in update.tensors:
        if tp.name not in shared:
            out[tp.name] = done[tp.name]
            continue
        src = by_name[shared[tp.name]]
        if (tp.checksum, tp.dtype, tuple(tp.shape)) != (src.checksum, src.dtype, tuple(src.shape)):
            raise WeightChecksumError(
                f"tensor {tp.name!r} of update v{update.version} shares memory with {src.name!r} (tied), but the "
                f"update gives them different contents")
        t = done[src.name]
        base = state.get(tp.name) if state is not None else None
        if inplace and base is not None and storage_key(base) != storage_key(t):
            if base.dtype != t.dtype or base.shape != t.shape:
                raise WeightVersionMismatch(f"tensor {tp.name!r}: the state has {_dtype_name(base.dtype)}"
                                            f"{list(base.shape)}, the update {tp.dtype}{list(tp.shape)}")
            base.copy_(t)  # untied in this state: keep its own tensor, with the same bits
            t = base
        out[tp.name] = t
    return out


def _apply_tensor(tp: TensorPayload, base: torch.Tensor | None, update: WeightUpdate, inplace: bool) -> torch.Tensor:
    where = f"tensor {tp.name!r} of update v{update.version}"
    dtype, shape = _dtype(tp.dtype), torch.Size(tp.shape)
    numel = shape.numel()
    width = torch.empty((), dtype=dtype).element_size()
    fits = base is not None and base.dtype == dtype and base.shape == shape
    if tp.scheme != "raw" and not fits:
        got = "missing" if base is None else f"{_dtype_name(base.dtype)}{list(base.shape)}"
        raise WeightVersionMismatch(f"{where} ({tp.scheme}) needs a base tensor {tp.dtype}{list(shape)} from "
                                    f"v{update.base_version}; the state has {got}")
    # Work on a CPU contiguous tensor we may write; copy back into `base` at the end when needed.
    if fits and inplace and base.device.type == "cpu" and base.is_contiguous():
        target = base
    elif fits and tp.scheme != "raw":
        target = base.detach().to("cpu", copy=True).contiguous()
    else:
        target = torch.empty(shape, dtype=dtype)
    bits = target.reshape(-1).view(torch.uint8).numpy().view(_UINT[width])
    if tp.scheme == "raw":
        if len(tp.data) != numel * width:
            raise WeightChecksumError(f"{where}: raw payload has {len(tp.data)} bytes, expected {numel * width}")
        bits[:] = np.frombuffer(tp.data, dtype=_UINT[width])
    elif tp.scheme == "dense":
        z = _unplanes(_decompress(tp.data, numel * width, where), _UINT[width])
        bits += _unzigzag(z)  # unsigned: wraps exactly like the encoder's subtraction
    elif tp.scheme == "sparse":
        count, split, gw = tp.info["count"], tp.info["gaps_nbytes"], tp.info["gap_width"]
        gaps = _unplanes(_decompress(tp.data[:split], count * gw, where), _UINT[gw])
        idx = np.cumsum(gaps.view(np.int64 if gw == 8 else np.int32), dtype=np.int64) - 1
        if count and (idx.min() < 0 or idx.max() >= numel):  # corrupt gaps; the sha256 would catch the rest
            raise WeightChecksumError(f"{where}: sparse indices out of range [0, {numel})")
        d = _unzigzag(_unplanes(_decompress(tp.data[split:], count * width, where), _UINT[width]))
        bits[idx] = bits[idx] + d
    elif tp.scheme != "same":
        raise WeightSyncError(f"{where}: unknown scheme {tp.scheme!r}")
    got = hashlib.sha256(bits).hexdigest()
    if got != tp.checksum:
        hint = " (is the base really the publisher's version?)" if tp.scheme != "raw" else ""
        raise WeightChecksumError(f"{where} ({tp.scheme}) reconstructs to sha256 {got[:16]}…, published "
                                  f"{tp.checksum[:16]}…{hint}")
    if fits and inplace and target is not base:
        base.copy_(target)  # e.g. a GPU or non-contiguous parameter: one copy back
        return base
    return target
