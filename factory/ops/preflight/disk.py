"""Disk checks for one directory (checkpoints, the lake): free space, then write + fsync + read-back throughput of a
temp file, its content verified (CRC-32: cheap next to the I/O, so a busy CPU hardly moves the rate).

The read is timed after the file's pages are dropped from the page cache (fsync, then POSIX_FADV_DONTNEED), so it
measures the device where the kernel honours that (ext4, xfs; tmpfs keeps its pages: there it measures memory).
The temp file is always removed; a failed write (full disk, read-only mount, missing directory) fails the write and
read checks with the OS error.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
import zlib
from pathlib import Path

from factory.ops.preflight.result import CheckResult

CHUNK = 4 << 20
SIZE_MB = {"quick": 32, "deep": 512}


def _payload(seed: int) -> bytes:
    # Random bytes, so a compressing or deduplicating filesystem cannot make the write look faster than the device.
    return random.Random(seed).randbytes(CHUNK)


def disk_checks(label: str, directory: Path, mode: str, *, free_floor_gb: float, write_floor_mbs: float,
                read_floor_mbs: float) -> list[CheckResult]:
    """`disk_free_<label>`, `disk_write_<label>`, `disk_read_<label>` for `directory`."""
    names = (f"disk_free_{label}", f"disk_write_{label}", f"disk_read_{label}")
    where = str(directory)
    t0 = time.perf_counter()
    try:
        free_gb = shutil.disk_usage(directory).free / 1e9
    except OSError as e:
        msg = f"{where}: {e.strerror or e}"
        return [CheckResult(n, False, message=msg) for n in names]
    free = CheckResult(names[0], free_gb >= free_floor_gb, round(free_gb, 3), free_floor_gb, "GB",
                       f">= {free_floor_gb:g}",
                       f"{free_gb:.2f} GB free in {where}" + ("" if free_gb >= free_floor_gb else
                                                              f", under the floor {free_floor_gb:g} GB: free space or "
                                                              f"move FACTORY_HOME"),
                       time.perf_counter() - t0)
    size = SIZE_MB[mode] << 20
    chunk = _payload(len(where))
    path = directory / f".preflight-{os.getpid()}-{time.monotonic_ns()}.tmp"
    try:
        t0 = time.perf_counter()
        crc = 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                for i in range(0, size, CHUNK):
                    block = i.to_bytes(8, "little") + chunk[8:]  # no two blocks alike
                    crc = zlib.crc32(block, crc)
                    view = memoryview(block)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            msg = f"cannot write a {size >> 20} MiB file in {where}: {e.strerror or e}"
            return [free, CheckResult(names[1], False, None, write_floor_mbs, "MB/s", f">= {write_floor_mbs:g}", msg,
                                      time.perf_counter() - t0),
                    CheckResult(names[2], False, None, read_floor_mbs, "MB/s", f">= {read_floor_mbs:g}",
                                f"not measured: {msg}")]
        write = _rate(names[1], size, time.perf_counter() - t0, write_floor_mbs, f"wrote and fsynced {size >> 20} MiB "
                      f"in {where}")
        t0 = time.perf_counter()
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                with contextlib.suppress(AttributeError, OSError):  # not every platform/filesystem has it
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                back = 0
                while block := os.read(fd, CHUNK):
                    back = zlib.crc32(block, back)
            finally:
                os.close(fd)
        except OSError as e:
            return [free, write, CheckResult(names[2], False, None, read_floor_mbs, "MB/s", f">= {read_floor_mbs:g}",
                                             f"cannot read back the file in {where}: {e.strerror or e}",
                                             time.perf_counter() - t0)]
        seconds = time.perf_counter() - t0
        if back != crc:
            return [free, write, CheckResult(names[2], False, None, read_floor_mbs, "MB/s", f">= {read_floor_mbs:g}",
                                             f"read back different bytes than were written in {where}: the disk or "
                                             f"its filesystem corrupts data", seconds)]
        read = _rate(names[2], size, seconds, read_floor_mbs,
                     f"read back {size >> 20} MiB in {where}, content verified")
        return [free, write, read]
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def _rate(name: str, size: int, seconds: float, floor: float, what: str) -> CheckResult:
    mbs = size / 1e6 / max(seconds, 1e-9)
    ok = mbs >= floor
    msg = f"{mbs:.0f} MB/s: {what}" if ok else f"{mbs:.0f} MB/s is under the floor {floor:g} MB/s ({what})"
    return CheckResult(name, ok, round(mbs, 1), floor, "MB/s", f">= {floor:g}", msg, seconds)
