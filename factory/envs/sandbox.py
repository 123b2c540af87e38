"""The sandbox pool: the only place generated code runs. It owns warm, isolated workers and their limits.

A `SandboxPool` keeps `size` warm workers (`Sandbox`, sandbox_handle.py). Each worker is a long-lived Python
process (a fork server, `sandbox_worker.py`) started inside bubblewrap (`sandbox_isolation.py`), with a few modules
preloaded; it runs one execution at a time under `SandboxLimits` and reports an `ExecResult`. A worker is
recycled after `recycle_after` runs, any fault (it died, hung, broke the protocol, could not kill or clean up
after the code) or an execution that left something a later one could reach, and replaced in the background;
`acquire()` pings the worker it lends.

Memory: RLIMIT_AS per process always, and a per-worker cgroup where this process may create one;
`metrics()["memory_limit"]` says which applies.

`isolation="none"` runs workers as plain processes (rlimits, timeouts and, as root, the uid switch still
apply) and logs a WARNING once: untrusted code is then not isolated from the host.

Between executions (see sandbox_worker.py and sandbox_confine.py for how): no execution can read another's
code, inputs, files or outputs, on the same worker (nothing of one is left in the fork server's memory) or on
another; and none finds state an earlier one left: each runs in IPC and mount namespaces of its own (fresh
/tmp, /dev/shm, SysV IPC and POSIX message queues; no keyrings) under a fork server that is pid 1 of its pid
namespace and resets it after each (sandbox_confine.py), what it leaves there goes with them (counted in
`ExecResult.leftovers`), and what it leaves where a later one could reach it gets the worker replaced
(`metrics()`: leftovers, leftover_kinds, recycled_for_leftovers). Where the kernel refuses those
namespaces, each execution gets a worker of its own (`metrics()["per_execution"]`: "worker"). With
isolation="none" executions share the host's filesystem outside /tmp, and without those namespaces also the
host's IPC, keyrings and /proc: unless the pool runs as root (then each worker's code has a uid of its own and a
0700 run directory) one can read another's run directory and, same uid, its process's memory.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Literal

import tenacity

from factory.envs import sandbox_confine, sandbox_frames, sandbox_worker
from factory.envs.sandbox_handle import Sandbox, _Stats
from factory.envs.sandbox_isolation import (
    REF_PROC,
    IsolationUnavailable,
    _bwrap_prefix,
    _Cgroups,
    _probe_bwrap,
    _python_layout,
    _world_readable,
)
from factory.envs.sandbox_types import LIMIT_MAX, ExecResult, SandboxLimits, SandboxRequestError, _check_request
from factory.infra.supervisor import retry

# The worker program, the isolation helpers and the data types live in their own modules; these names are
# importable from here.
__all__ = ["LIMIT_MAX", "PRELOAD", "ExecResult", "IsolationUnavailable", "Sandbox", "SandboxLimits", "SandboxPool",
           "SandboxRequestError"]

log = logging.getLogger(__name__)

# Modules the worker imports before it forks, so the code's own imports of them cost nothing. Each costs
# cold-start time (unittest ~15 ms, dataclasses ~8 ms); SandboxPool(preload=...) picks others.
PRELOAD = ("collections", "functools", "itertools", "math", "re", "json", "string", "heapq", "bisect")

# Between failed starts of a worker: 0.1 s, doubling, at most 5 s.
SPAWN_WAIT = tenacity.wait_exponential(multiplier=0.1, max=5.0)


_WARNED_UNISOLATED = False


def _warn_unisolated(own_uid: bool, stdlib_unreadable: bool) -> None:
    global _WARNED_UNISOLATED
    if not _WARNED_UNISOLATED:
        _WARNED_UNISOLATED = True
        log.warning("!!! SandboxPool(isolation='none'): untrusted code is NOT isolated: it runs as a plain "
                    "process on this host, with its filesystem and network (only rlimits, timeouts%s apply). "
                    "Use isolation='bwrap' for generated code. !!!%s",
                    " and a uid of its own" if own_uid else "",
                    " The code's uid cannot read the interpreter's files here, so it can import only the "
                    "modules the workers preloaded (a python outside /root, e.g. /usr/bin/python3, avoids this)."
                    if stdlib_unreadable else "")




# The worker's program, run with `python -I -S -c`: the modules it imports (standard library only, and one another)
# installed under their own names from the arguments after its config, then sandbox_worker.py's text (the last
# argument) run as __main__.
_WORKER_MODULES = (sandbox_frames, sandbox_confine)
_BOOT = f"""
import sys, types
for name in ("factory", "factory.envs"):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = []
for name, text in zip({[m.__name__ for m in _WORKER_MODULES]!r}, sys.argv[2:]):
    module = sys.modules[name] = types.ModuleType(name)
    module.__file__ = name.rsplit(".", 1)[1] + ".py"
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    setattr(sys.modules["factory.envs"], name.rsplit(".", 1)[1], module)
exec(compile(sys.argv[-1], "sandbox_worker.py", "exec"), {{"__name__": "__main__"}})
"""


def _worker_sources() -> list[str]:
    """The texts of the worker's modules, in _BOOT's order, sandbox_worker.py's last."""
    out = []
    for module in (*_WORKER_MODULES, sandbox_worker):
        with open(module.__file__, encoding="utf-8") as f:
            out.append(f.read())
    return out


_TMP_PREFIX = "factory-sandbox-"


def _remove_stale_tmpdirs() -> None:
    """Scratch dirs left by pools whose process died without closing them (killed, or power cut)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            pid = entry.name[len(_TMP_PREFIX):].split("-", 1)[0]
            if entry.name.startswith(_TMP_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(entry.path, ignore_errors=True)


def _pin(cpus: frozenset[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


class SandboxPool:
    """`size` warm sandboxes; see the module docstring. Thread-safe: many threads may `run()` at once.

    Extra keyword arguments: bwrap (the bubblewrap executable, name or path), cgroups (use per-worker
    cgroups where this process may create them), startup_timeout (seconds for a worker to answer),
    preload (modules each worker imports before it forks; default PRELOAD), cpus (placement: the cores the
    workers run on; default: the caller's), allow_userns (let the code create user namespaces, for a
    task that needs them; default: denied).
    """

    def __init__(self, size: int = 4, isolation: Literal["bwrap", "none"] = "bwrap",
                 limits: SandboxLimits = SandboxLimits(), recycle_after: int = 100, python: str = sys.executable,  # noqa: B008
                 *, bwrap: str = "bwrap", cgroups: bool = True, startup_timeout: float = 30.0,
                 preload: tuple[str, ...] = PRELOAD, cpus: Iterable[int] | None = None, allow_userns: bool = False):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if recycle_after < 1:
            raise ValueError(f"recycle_after must be >= 1, got {recycle_after}")
        if isolation not in ("bwrap", "none"):
            raise ValueError(f"isolation must be 'bwrap' or 'none', got {isolation!r}")
        self.size, self.isolation, self.limits, self.recycle_after = size, isolation, limits, recycle_after
        self.startup_timeout, self.preload = startup_timeout, tuple(preload)
        self.allow_userns = bool(allow_userns)
        self._layout = _python_layout(python)
        # As root, the code always runs as a random uid of its own (see the module docstring): code running
        # as root outside a pid namespace could `kill -9 -1` every process on the host.
        self._root = self._drop_uid = os.geteuid() == 0
        self._tmp_mb = max(64, 4 * limits.file_size_mb)
        if isolation == "bwrap":
            exe = shutil.which(bwrap)
            if exe is None:
                raise IsolationUnavailable(f"bubblewrap not found ({bwrap!r} is not an executable on PATH or a "
                                           f"path to one): install the bubblewrap package, or use isolation='none'")
            self._prefix = _bwrap_prefix(exe, self._layout, self._root, self._tmp_mb)
            _probe_bwrap(self._prefix, self._layout.executable)
        else:
            self._prefix = []
            # Without bwrap the code's uid sees the host's modes: under a 0700 /root (a pyenv install) it can
            # import only what the worker preloaded.
            _warn_unisolated(self._drop_uid, self._drop_uid and not _world_readable(self._layout.base_prefix))
        self._cgroups = _Cgroups.detect() if cgroups else None
        self._stats = _Stats()
        self._idle: queue.Queue[Sandbox] = queue.Queue()
        self._live: set[Sandbox] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._started = False
        self._serial = 0
        self._last_error = ""
        self._tmpdir: str | None = None
        self._sources = _worker_sources()
        self._fresh = True  # ask workers for namespaces of its own for every execution (tests turn it off)
        self._warned_not_fresh = False
        # Workers are spawned from these long-lived threads only: bwrap --die-with-parent ties a worker to
        # the thread that forked it, so a short-lived caller thread would take its workers with it.
        # Placement: a worker inherits the cores of the thread that forks it.
        self.cpus = frozenset(cpus) if cpus else None
        self._spawner = ThreadPoolExecutor(max_workers=min(size, 4), thread_name_prefix="sandbox-spawn",
                                           initializer=_pin, initargs=(self.cpus,))

    @property
    def memory_limit(self) -> str:
        return self._cgroups.kind if self._cgroups is not None else "rlimit_as"

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> SandboxPool:
        """Start `size` warm workers; RuntimeError if they do not all answer within startup_timeout."""
        if self._closed.is_set():
            raise RuntimeError("sandbox pool is closed")
        if self._started:
            return self
        self._started = True
        _remove_stale_tmpdirs()
        self._tmpdir = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-")
        os.chmod(self._tmpdir, 0o711)  # the code's own uid (none mode, as root) must reach its scratch dir
        if self._cgroups is not None:
            self._cgroups.remove_stale()
        futures = [self._spawner.submit(self._spawn, 3) for _ in range(self.size)]
        done, pending = wait_futures(futures, timeout=self.startup_timeout)
        ok = sum(1 for f in done if f.result())
        if ok < self.size:
            self.close()
            raise RuntimeError(f"sandbox pool: {ok} of {self.size} workers started within {self.startup_timeout} s "
                               f"(last error: {self._last_error or 'none'})")
        return self

    def __enter__(self) -> SandboxPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker (also ones lent out: their holders get a fault result) and the spawner."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            live = list(self._live)
            self._live.clear()
        for sb in live:
            sb.kill()
        for sb in live:
            sb.reap()
        self._spawner.shutdown(wait=True, cancel_futures=True)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _worker_argv(self, scratch: str, drop_uid: int | None) -> list[str]:
        sandboxed = self.isolation == "bwrap"
        cfg = {"scratch": "/tmp" if sandboxed else scratch, "wipe": ["/tmp", "/dev/shm"] if sandboxed else [scratch],
               "drop_uid": drop_uid, "pidns": sandboxed, "preload": list(self.preload),
               "deny_userns": not self.allow_userns, "fresh": self._fresh, "tmp_mb": self._tmp_mb,
               "ref_proc": REF_PROC if sandboxed and self._root else None}
        return [*self._prefix, self._layout.executable, "-I", "-S", "-c", _BOOT, json.dumps(cfg), *self._sources]

    def _make_sandbox(self) -> Sandbox:
        """A new, not yet started worker (its scratch dir, cgroup and command line)."""
        with self._lock:
            self._serial += 1
            name = f"{os.getpid()}-{self._serial}"
        scratch = os.path.join(self._tmpdir, f"w{name}")
        os.mkdir(scratch, 0o700)
        cgroup = self._cgroups.create(name) if self._cgroups is not None else None
        # A fresh uid per worker, far above the host's users' range: RLIMIT_NPROC counts per uid.
        drop_uid = random.randrange(1 << 20, 1 << 30) if self._drop_uid else None
        if drop_uid is not None:
            os.chown(scratch, drop_uid, drop_uid)  # the fork server runs as that uid when it can (sandbox_confine)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"}
        return Sandbox(self._worker_argv(scratch, drop_uid), env, scratch, self.limits, self._stats, cgroup,
                       os.path.join(self._tmpdir, f"w{name}.log"), name)

    def _spawn(self, attempts: int | None = None) -> bool:
        """Start one worker and make it idle; retries with backoff (forever if attempts is None) until the
        pool closes. Runs on the spawner threads."""
        tries = itertools.count(1)  # the attempt a failure log names

        def start() -> bool:
            if self._closed.is_set():
                return False
            sb = None
            try:
                sb = self._make_sandbox()
                seconds = sb.start(self.startup_timeout)
            except Exception as e:  # noqa: BLE001 - count it, retry, keep the pool going
                with self._stats.lock:
                    self._stats.failures += 1
                self._last_error = f"{type(e).__name__}: {e}"
                log.warning("sandbox worker failed to start (try %d): %s", next(tries), self._last_error)
                if sb is not None:
                    sb.reap()
                raise
            with self._stats.lock:
                self._stats.cold_starts += 1
                self._stats.cold_start_s.append(seconds)
                del self._stats.cold_start_s[:-1000]
                self._stats.per_execution.add(self._per_execution(sb))
            with self._lock:
                if self._closed.is_set():
                    closed = True
                else:
                    closed = False
                    self._live.add(sb)
            if closed:
                sb.kill()
                sb.reap()
                return False
            self._idle.put(sb)
            return True

        try:
            # Count it, back off (0.1 s doubling to 5 s; a close cuts the pause short), retry: the pool goes on.
            return retry(start, attempts=attempts, on=Exception, wait=SPAWN_WAIT, sleep=self._closed.wait)
        except Exception:  # noqa: BLE001 - the last of `attempts` failed starts, already counted and logged
            return False

    def _per_execution(self, sb: Sandbox) -> str:
        """What an execution on sb has to itself: namespaces, a whole worker, or (unisolated, without namespaces
        of its own) neither."""
        if sb.fresh:
            return "namespaces"
        if not self._warned_not_fresh:
            self._warned_not_fresh = True
            log.warning("sandbox: executions cannot have namespaces of their own here (%s): %s", sb.why_not_fresh,
                        "each gets a worker of its own (slower)" if self.isolation == "bwrap" else
                        "with isolation='none' they share the host's IPC, keyrings and counters")
        return "worker" if self.isolation == "bwrap" else "shared"

    def _retire(self, sb: Sandbox, fault: bool, leftovers: bool = False) -> None:
        """Take sb out of service and start a replacement in the background."""
        with self._lock:
            known = sb in self._live
            self._live.discard(sb)
        with self._stats.lock:
            self._stats.recycled += 1
            self._stats.failures += int(fault)
            self._stats.recycled_for_leftovers += int(leftovers)
        if fault:
            log.warning("sandbox worker %s recycled after a fault: %s%s", sb.name, sb.fault or "marked unhealthy",
                        sb._log_tail())
        elif leftovers:
            log.warning("sandbox worker %s recycled: an execution left %s where a later one could reach it", sb.name,
                        ", ".join(sb.dirty))
        sb.kill()
        if known and not self._closed.is_set():
            with contextlib.suppress(RuntimeError):  # the spawner shut down: the pool is closing
                self._spawner.submit(sb.reap)
                self._spawner.submit(self._spawn)
        else:
            sb.reap()

    # -- lending -----------------------------------------------------------------------------------------

    def acquire(self, timeout: float | None = 30.0) -> Sandbox:
        """A warm sandbox (answered a ping just now). TimeoutError if none is free in time."""
        if not self._started:
            raise RuntimeError("sandbox pool not started: call start() or use it as a context manager")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed.is_set():
                raise RuntimeError("sandbox pool is closed")
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                sb = self._idle.get(timeout=remaining)
            except queue.Empty:
                raise TimeoutError(f"no sandbox free within {timeout} s (pool size {self.size}; metrics "
                                   f"{self.metrics()}; last start error: {self._last_error or 'none'})") from None
            if sb.ping():
                with self._stats.lock:
                    self._stats.busy += 1
                return sb
            self._retire(sb, fault=True)

    def release(self, sb: Sandbox, healthy: bool = True) -> None:
        """Give sb back; it is recycled if unhealthy, faulted, dead or used recycle_after times."""
        with self._stats.lock:
            self._stats.busy -= 1
        if not healthy and sb.fault is None:
            sb.fault = "released as unhealthy"
        if self._closed.is_set():
            sb.kill()
            sb.reap()
            return
        if sb.fault is not None or not sb.alive():
            self._retire(sb, fault=True)
        elif sb.dirty:
            self._retire(sb, fault=False, leftovers=True)
        elif sb.uses >= self.recycle_after or (sb.uses and not sb.fresh and self.isolation == "bwrap"):
            self._retire(sb, fault=False)  # without namespaces per execution, a worker serves one
        else:
            self._idle.put(sb)

    @contextlib.contextmanager
    def sandbox(self, timeout: float | None = 30.0) -> Iterator[Sandbox]:
        """Acquire, yield, release; an exception out of the block recycles the sandbox."""
        sb = self.acquire(timeout)
        healthy = False
        try:
            yield sb
            healthy = True
        finally:
            self.release(sb, healthy=healthy)

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None,
            limits: SandboxLimits | None = None) -> ExecResult:
        """Run code in a warm sandbox. Never raises for anything the code does (ok=False and a reason);
        raises for the caller's mistakes (SandboxRequestError: bad file names, text that is not Unicode) and the
        pool's (RuntimeError: closed; TimeoutError: none free in 30 s)."""
        _check_request(code, stdin, files)
        with self.sandbox() as sb:
            return sb.exec(code, stdin=stdin, files=files, limits=limits)

    def health_check(self) -> int:
        """Ping every idle worker; replace those that do not answer. Returns how many were replaced."""
        idle: list[Sandbox] = []
        while True:
            try:
                idle.append(self._idle.get_nowait())
            except queue.Empty:
                break
        replaced = 0
        for sb in idle:
            if sb.ping():
                self._idle.put(sb)
            else:
                replaced += 1
                self._retire(sb, fault=True)
        return replaced

    def metrics(self) -> dict[str, Any]:
        """warm (idle, ready), busy (lent out), cold_starts (workers started, replacements included),
        failures (worker faults and failed starts), recycled (workers retired: after recycle_after uses, a
        fault, or leftovers), executions, plus the isolation, the memory limit mechanism and cold start times;
        per_execution (what each execution has to itself: "namespaces", a "worker", or, unisolated without
        namespaces, "shared"), leftovers (executions that left anything), leftover_kinds (their count by kind)
        and recycled_for_leftovers (workers replaced because a later execution could have reached it)."""
        with self._stats.lock:
            s = self._stats
            cold = sorted(s.cold_start_s)
            return {"size": self.size, "warm": self._idle.qsize(), "busy": s.busy, "cold_starts": s.cold_starts,
                    "failures": s.failures, "recycled": s.recycled, "executions": s.executions,
                    "isolation": self.isolation, "memory_limit": self.memory_limit,
                    "code_uid": "own random uid" if self._drop_uid else "worker's uid",
                    "cold_start_p50_ms": round(cold[len(cold) // 2] * 1000, 2) if cold else None,
                    "per_execution": "/".join(sorted(s.per_execution)) or None, "leftovers": s.leftovers,
                    "leftover_kinds": dict(s.leftover_kinds), "recycled_for_leftovers": s.recycled_for_leftovers}

