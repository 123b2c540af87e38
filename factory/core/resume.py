"""Resume points: everything a run needs to continue exactly where it was, on disk, atomic and verified.

A resume point after step S holds the model's weights, the optimizer's state, every RNG (torch, python, numpy, the
trainer's minibatch shuffle, every CUDA device's where CUDA is in use), the loop's own counters, the prompt stream's
position with the prompts still in flight (served again after a resume: never skipped, never trained twice), the
rollout buffer's scored groups not yet trained, and the `state_dict()` of anything else stateful the loop drives
(`extra`, e.g. a data blender). Prompt sampling is seeded per draw, so the stream's position covers the producers'
and the sampler's randomness.

Every tensor is copied to the CPU (from a GPU through a pinned host buffer), so a resume point loads on any
device: the model and optimizer `load_state_dict` copy it to wherever the run placed them.

Saving does not stall the trainer for the write: `capture` copies the state into memory between two steps
(milliseconds on small models: the stall that `ResumeWriter.stall_ms` measures), and a background thread
writes it: files into a temp directory, each fsynced, a manifest (factory/digest.py's format: the sha256 of
every file and of the whole) written last, then one rename and an fsync of the parent. A directory without a
complete, matching manifest is not a resume point: `latest()` skips it (and says why) and takes the previous
one. Resume points written with the earlier manifest format still load. The last `keep` are kept.

Layout: `<run dir>/resume/step-000120/{model.safetensors, optimizer.pt, rng.pt, state.json, MANIFEST.json}`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from factory.digest import hash_blobs, manifest_entries
from factory.digest import manifest as tree_manifest
from factory.infra.device import host_copy
from factory.infra.disk import DiskFull, is_disk_full
from factory.infra.faults import fault_point
from factory.infra.liveness import covered, pulse
from factory.progress import Log

FORMAT = 1  # of state.json; the manifest is factory/digest.py's
MANIFEST = "MANIFEST.json"
PREFIX = "step-"


class ResumeError(RuntimeError):
    """No usable resume point, or one that does not fit the run it is loaded into."""


@dataclass
class TrainState:
    """A run's whole state after `step` trained steps, held in memory (tensors are private copies)."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    loop: dict[str, Any] = field(default_factory=dict)  # the loop's counters, the prompt stream, the buffer
    extra: dict[str, Any] = field(default_factory=dict)  # state_dict() of other stateful parts, by name


def rng_state(shuffle: torch.Generator | None = None) -> dict[str, Any]:
    """Every RNG the process uses: torch's global one, python's, numpy's, the trainer's shuffle, and where CUDA is
    in use, every CUDA device's (`cuda`: one state per visible device)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    # is_initialized, not is_available: a process that never touched the GPU has no CUDA stream to restore, and
    # asking for it would initialise CUDA (and fail on machines where the driver is there but unusable).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if shuffle is not None:
        state["shuffle"] = shuffle.get_state()
    return state


def set_rng_state(state: dict[str, Any], shuffle: torch.Generator | None = None) -> None:
    """Restore what `rng_state` took. A resume point without CUDA states (older ones, or taken on the CPU) leaves
    the CUDA generators as they are; one with CUDA states resumed where torch sees no GPU ignores them (nothing
    there draws from a CUDA generator); with a different number of visible GPUs it is refused."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ResumeError(f"the resume point holds the RNG states of {len(cuda)} CUDA device(s), but this "
                              f"process sees {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES): resume it with "
                              f"the same GPUs visible")
        torch.cuda.set_rng_state_all(cuda)
    if shuffle is not None and "shuffle" in state:
        shuffle.set_state(state["shuffle"])


def _copy(obj: Any) -> Any:
    """A deep copy whose tensors are detached CPU clones (what the optimizer holds keeps changing)."""
    if isinstance(obj, torch.Tensor):
        return host_copy(obj)
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_copy(v) for v in obj)
    return obj


def capture(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: dict[str, Any],
            loop: dict[str, Any], extra: dict[str, Any] | None = None) -> TrainState:
    """Copy the state into memory (the only part of a save the trainer waits for): every tensor to the CPU, so the
    resume point loads on any device (`load_state_dict` copies into the model where it is)."""
    return TrainState(step=step, model={k: host_copy(v) for k, v in model.state_dict().items()},
                      optimizer=_copy(optimizer.state_dict()), rng=_copy(rng), loop=json.loads(json.dumps(loop)),
                      extra=json.loads(json.dumps(extra or {})))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(state: TrainState, root: Path, keep: int) -> Path:
    """Write `state` as `root/step-NNNNNN` atomically (see the module docstring); keep the newest `keep`."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:06d}"
    tmp = root / f".{final.name}.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    files = {
        # Tied weights share storage; the copies made by capture() do not, which safetensors needs.
        "model.safetensors": save_safetensors(state.model),
        "optimizer.pt": _torch_bytes(state.optimizer),
        "rng.pt": _torch_bytes(state.rng),
        "state.json": json.dumps({"format": FORMAT, "step": state.step, "loop": state.loop,
                                  "extra": state.extra}).encode(),
    }
    try:
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            fault_point("resume_write", tmp / name)  # a kill here leaves a torn temp dir, never a resume point
            pulse()
        manifest = tree_manifest(hash_blobs(files), step=state.step)
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. on a signal right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous resume point stays the newest, intact
        if is_disk_full(e):
            raise DiskFull(root, e) from e
        raise
    for old in sorted(points(root))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(f".{PREFIX}*.tmp-*"):  # temp dirs of killed writers
        if stale != tmp:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def points(root: Path) -> list[Path]:
    """Resume-point directories under `root` (complete or not), oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify(path: Path) -> str | None:
    """None if `path` is a complete resume point whose files match its manifest, else what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (a write that did not finish)"
    except (OSError, ValueError) as e:
        return f"unreadable manifest: {e}"
    try:
        entries = manifest_entries(manifest)
    except ValueError as e:  # a format this version does not read
        return str(e)
    except (KeyError, TypeError) as e:
        return f"unreadable manifest: {e!r}"
    for want in entries:
        name = want["path"]
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        data = f.read_bytes()
        if len(data) != want["bytes"] or _sha256(data) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest (torn or corrupted)"
        pulse()  # a large resume point takes seconds to verify (infra/liveness.py)
    return None


def load(path: Path) -> TrainState:
    """Read a verified resume point (call `verify` first, or use `latest`)."""
    meta = json.loads((path / "state.json").read_text())
    return TrainState(
        step=int(meta["step"]),
        model=load_safetensors((path / "model.safetensors").read_bytes()),
        optimizer=torch.load(path / "optimizer.pt", weights_only=True),
        # python's RNG state is a tuple of ints and numpy's holds an ndarray: not weights_only material.
        # The file is our own, verified against its manifest.
        rng=torch.load(path / "rng.pt", weights_only=False),
        loop=meta["loop"], extra=meta["extra"])


def latest(root: Path, log: Log) -> tuple[TrainState, Path] | None:
    """The newest complete resume point under `root` (torn or corrupt ones are skipped, and said so to `log`)."""
    for path in reversed(points(root)):
        problem = verify(path)
        if problem is None:
            with covered():  # torch.load of a large optimizer state: one long call (infra/liveness.py)
                return load(path), path
        log(f"resume point {path.name} skipped: {problem}")
    return None


class ResumeWriter:
    """Writes resume points in a background thread, one at a time; a new save waits for the previous one.

    `stall_ms` lists, per save, how long the caller was held: the in-memory copy plus any wait for the
    previous write. Errors of a background write are raised by the next `submit` or by `wait`."""

    def __init__(self, root: Path, keep: int, before_write: Callable[[int], None] | None = None,
                 log_path: Path | None = None):
        self.root, self.keep = root, keep
        self.log_path = log_path  # one JSON line per save: step, stall_ms, write_s
        self.before_write = before_write  # runs in the writer thread first, e.g. flushing the step rows
        self.stall_ms: list[float] = []
        self.write_s: list[float] = []
        self.last_path: Path | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, make_state: Callable[[], TrainState], wait: bool = False) -> None:
        """Snapshot now (`make_state`), write in the background (or before returning, with `wait`)."""
        t0 = time.perf_counter()
        self.wait()
        state = make_state()
        self.stall_ms.append((time.perf_counter() - t0) * 1e3)
        self._thread = threading.Thread(target=self._write, args=(state,), name="resume-writer", daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    def _write(self, state: TrainState) -> None:
        t0 = time.perf_counter()
        try:
            if self.before_write is not None:
                self.before_write(state.step)
            self.last_path = write(state, self.root, self.keep)
            self.write_s.append(time.perf_counter() - t0)
            if self.log_path is not None:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps({"step": state.step, "stall_ms": self.stall_ms[-1],
                                        "write_s": self.write_s[-1], "at": time.time()}) + "\n")
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer's thread
            self._error = e

    def wait(self) -> None:
        """Block until the write in progress is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise ResumeError(f"writing a resume point under {self.root} failed: {err!r}") from err
