"""Riding out a lake outage: rows a run could not write are kept in a durable local spool and flushed, in order,
when the catalog answers again.

A `Spool` is a directory (a run's `checkpoints/<run_id>/spool/`) of one JSON file per deferred upsert,
`<seq>-<table>.json`, each written to a temp file, fsynced and renamed, so a kill leaves whole entries or none.
`flush` replays them oldest first into the lake and deletes each once committed. Upserts are keyed
(`Lake.upsert`), so an entry replayed twice (a kill between its commit and its deletion) writes the same rows
again and duplicates nothing; replaying in order keeps the last write of a key the one that wins.

`SpooledLake` is what a run writes through: an upsert goes to the lake, or into the spool when the lake fails
with an outage error (`is_outage`: the catalog's database unreachable or locked, its REST server gone, its files
unreadable) or while older entries still wait (so they keep their order). The spool records when the outage
began; the run reads `outage_s()` against `ops.lake_outage_s` and stops at a resume point past it (`LakeDown`).
Reads are passed through: a reader during an outage gets the error.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any

import httpx
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from factory.infra.disk import DiskFull, is_disk_full
from factory.infra.faults import fault_point
from factory.lake.writer import Lake

log = logging.getLogger(__name__)

SPOOL = "spool"  # the directory under a run's directory
PROBE_EVERY_S = 2.0  # while the lake is down, how often a write tries it again (the others go straight to the spool)


class LakeDown(RuntimeError):
    """The lake stayed unreachable past the run's budget (ops.lake_outage_s)."""


def is_outage(e: BaseException) -> bool:
    """Whether `e` says the lake is unreachable (worth waiting out), as opposed to a bad row or a bug."""
    if is_disk_full(e):
        return False  # a full disk is its own stop (factory/infra/disk.py), not an outage to wait out
    if isinstance(e, OperationalError | InterfaceError | DisconnectionError | PoolTimeout | httpx.TransportError):
        return True
    if isinstance(e, DBAPIError) and e.connection_invalidated:
        return True
    return isinstance(e, OSError)  # sockets, an object store, the warehouse's files


def is_catalog_error(e: BaseException) -> bool:
    """An outage error of the catalog's database or REST server (`is_outage`, less plain OSErrors: at the top of a
    command those may be anything, e.g. a bug or a missing file)."""
    return isinstance(e, SQLAlchemyError | httpx.TransportError) and is_outage(e)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()  # Lake.upsert reads ISO-8601 strings back as timestamps
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return value.item()
    raise TypeError(f"cannot spool a {type(value).__name__}")


class Spool:
    """Deferred upserts of one run, on disk under `root`, and the state of the outage (shared by the run's
    threads, each with its own Lake)."""

    def __init__(self, root: Path, clock: Callable[[], float] = time.monotonic):
        self.root = root
        self.clock = clock
        self._lock = threading.RLock()
        self.down_since: float | None = None  # clock() at the first failure of the current outage
        self.last_error = ""
        self.last_probe = 0.0

    def pending(self) -> list[Path]:
        """The entries not yet in the lake, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.suffix == ".json" and not p.name.startswith("."))

    def put(self, table: str, rows: Sequence[Mapping[str, Any]]) -> Path:
        """Keep `rows` for `table` until `flush`: durably (temp file, fsync, rename). DiskFull when the disk is."""
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            last = self.pending()
            seq = int(last[-1].name.split("-", 1)[0]) + 1 if last else 1
            final = self.root / f"{seq:09d}-{table}.json"
            tmp = self.root / f".{final.name}.tmp"
            try:
                fault_point("spool_write", tmp)
                data = json.dumps({"table": table, "rows": [dict(r) for r in rows]}, default=_jsonable)
                with open(tmp, "w") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
                fd = os.open(self.root, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if is_disk_full(e):
                    raise DiskFull(self.root, e) from e
                raise
            return final

    def flush(self, lake: Lake) -> int:
        """Replay every entry into `lake`, oldest first; returns how many rows were written. An error (the lake
        still down) is raised after the entries before it are committed and deleted; the rest stay."""
        n = 0
        with self._lock:
            for entry in self.pending():
                body = json.loads(entry.read_text())
                n += lake.upsert(body["table"], body["rows"])
                entry.unlink()
            self.down_since = None
        return n

    def failed(self, e: BaseException) -> None:
        """The lake failed with an outage error now."""
        with self._lock:
            if self.down_since is None:
                self.down_since = self.clock()
                log.warning("lake: unavailable (%s); spooling rows under %s", e, self.root)
            self.last_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]

    def outage_s(self) -> float:
        """How long the current outage has lasted (0 when the lake answers)."""
        since = self.down_since
        return 0.0 if since is None else self.clock() - since


class SpooledLake:
    """A Lake for one thread whose upserts survive an outage (see the module docstring); `opener` makes the Lake
    on first use (opening it is itself a call to the catalog)."""

    def __init__(self, opener: Callable[[], Lake], spool: Spool, probe_every_s: float = PROBE_EVERY_S):
        self._opener = opener
        self._lake: Lake | None = None
        self.spool = spool
        self.probe_every_s = probe_every_s

    @property
    def lake(self) -> Lake:
        if self._lake is None:
            self._lake = self._opener()
        return self._lake

    def upsert(self, table: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Into the lake, or into the spool if the lake is down or older rows still wait there."""
        if not rows:
            return 0
        spool = self.spool
        if spool.down_since is None and not spool.pending():
            try:
                return self.lake.upsert(table, rows)
            except Exception as e:
                if not is_outage(e):
                    raise
                spool.failed(e)
        spool.put(table, rows)
        self.try_flush()
        return len(rows)

    def try_flush(self, force: bool = False) -> bool:
        """Flush the spool if the lake answers (tried at most every `probe_every_s` while it is down); whether
        the spool is empty now."""
        spool = self.spool
        if not spool.pending():
            spool.down_since = None
            return True
        now = spool.clock()
        if not force and spool.down_since is not None and now - spool.last_probe < self.probe_every_s:
            return False
        spool.last_probe = now
        try:
            spool.flush(self.lake)
        except Exception as e:
            if not is_outage(e):
                raise
            spool.failed(e)
            return False
        log.info("lake: available again; spooled rows flushed")
        return True

    def drain(self, budget_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
        """Wait until the spool is flushed, for as long as the outage stays within `budget_s`; LakeDown past it."""
        while not self.try_flush(force=True):
            if self.spool.outage_s() > budget_s:
                raise LakeDown(down_message(self.spool, budget_s))
            sleep(self.probe_every_s)

    def read(self, table: str, row_filter: Any = None) -> Any:
        return self.lake.read(table, row_filter)

    def delete(self, table: str, row_filter: Any) -> None:
        self.lake.delete(table, row_filter)

    def table(self, name: str) -> Any:
        return self.lake.table(name)

    def close(self) -> None:
        if self._lake is not None:
            self._lake.close()


def down_message(spool: Spool, budget_s: float) -> str:
    """The one-line cause of a stop for a lake that stayed down."""
    return (f"lake unavailable for {spool.outage_s():.0f} s (ops.lake_outage_s = {budget_s:g}): {spool.last_error}; "
            f"{len(spool.pending())} spooled write(s) kept under {spool.root}")
