"""Checkpoint uploads to the object store beside training: a worker thread and a bounded queue.

A run saves each checkpoint to local disk in its loop (fast) and hands the upload (`publish_checkpoint`: every
file, then the manifest) to `BackgroundUploads`, so the loop does not wait for the network. It waits only when
`depth` uploads are already queued behind the one in flight (a store slower than the checkpoints come: the backlog,
and the local disk it pins, stays bounded) and at `wait()`, which the run calls at its end.

Failures are not lost: each is logged when it happens, and the first one is raised by the next `submit` or by
`wait` (`UploadFailed`), so an attempt whose uploads fail stops as an upload in its loop would have made it stop,
and is resumed; `wait(raise_errors=False)` only reports them (an attempt already failing for another reason).
`on_done(uri)` runs in the worker thread once a checkpoint is on the store (the run records its URI there).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from factory.models.checkpoint import publish_checkpoint

DEFAULT_DEPTH = 2  # uploads queued behind the one in flight before `submit` waits


class UploadFailed(RuntimeError):
    """A checkpoint upload running beside training failed."""


@dataclass(frozen=True)
class _Job:
    local: Path
    base_uri: str
    name: str
    digest: str | None
    on_done: Callable[[str], object] | None


class BackgroundUploads:
    """One worker thread uploading checkpoints in submission order; at most `depth` waiting behind it."""

    def __init__(self, depth: int = DEFAULT_DEPTH, log: Callable[[str], object] = print,
                 publish: Callable[..., str] = publish_checkpoint):
        if depth < 1:
            raise ValueError(f"depth: uploads queued behind the one in flight must be at least 1, got {depth}")
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=depth)
        self._log, self._publish = log, publish
        self._lock = threading.Lock()
        self._errors: list[str] = []
        self._raised = 0  # errors already raised to the caller
        self.uploaded: list[str] = []  # URIs, in the order they completed
        self._thread = threading.Thread(target=self._work, name="checkpoint-uploads", daemon=True)
        self._thread.start()

    def submit(self, local: str | Path, base_uri: str, name: str, digest: str | None = None,
               on_done: Callable[[str], object] | None = None) -> None:
        """Queue the upload of the checkpoint at `local` to `<base_uri>/<name>/<sha256>`; returns at once unless
        `depth` uploads are already waiting. Raises `UploadFailed` if an earlier upload failed."""
        self._raise_new()
        self._jobs.put(_Job(Path(local), base_uri, name, digest, on_done))

    def pending(self) -> int:
        """Uploads submitted and not yet finished (queued or in flight)."""
        return self._jobs.unfinished_tasks

    def wait(self, raise_errors: bool = True) -> list[str]:
        """Block until every submitted upload has finished; return the errors, raising the first new one as
        `UploadFailed` unless `raise_errors` is False."""
        self._jobs.join()
        if raise_errors:
            self._raise_new()
        with self._lock:
            return list(self._errors)

    def close(self, raise_errors: bool = True) -> list[str]:
        """`wait`, then stop the worker thread."""
        try:
            return self.wait(raise_errors)
        finally:
            self._jobs.put(None)
            self._thread.join()

    def _raise_new(self) -> None:
        with self._lock:
            new = self._errors[self._raised:]
            self._raised = len(self._errors)
        if new:
            raise UploadFailed(f"{len(new)} checkpoint upload(s) failed: {'; '.join(new)}")

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                uri = self._publish(job.local, job.base_uri, job.name, job.digest)
                if job.on_done is not None:
                    job.on_done(uri)
                self.uploaded.append(uri)
            except Exception as e:  # noqa: BLE001 - kept and raised in the caller's thread
                assert job is not None
                msg = f"{job.local} -> {job.base_uri}/{job.name}: {type(e).__name__}: {e}"
                with self._lock:
                    self._errors.append(msg)
                self._log(f"checkpoint upload failed: {msg}")
            finally:
                self._jobs.task_done()
