"""The sandbox pool: the only place generated code runs. It owns warm, isolated workers and their limits.

A `SandboxPool` keeps `size` warm workers. Each worker is a long-lived Python process (a fork server,
`sandbox_worker.py`) started inside bubblewrap (`sandbox_isolation.py`), with a few modules preloaded; it
runs one execution at a time under `SandboxLimits` and reports an `ExecResult`. A worker is recycled after
`recycle_after` runs or any fault (it died, hung, broke the protocol, could not kill or clean up after
the code) and replaced in the background; `acquire()` pings the worker it lends.

Memory: RLIMIT_AS per process always, and a per-worker cgroup where this process may create one;
`metrics()["memory_limit"]` says which applies.

`isolation="none"` runs workers as plain processes (rlimits, timeouts and, as root, the uid switch still
apply) and logs a WARNING once: untrusted code is then not isolated from the host.

Between executions (see sandbox_worker.py for how): under bwrap no execution can read another's code,
inputs, files or outputs, on the same worker (nothing of one is left in the fork server's memory or on
disk for the next) or on another (own pid, mount and ipc namespaces, own /tmp). With isolation="none" the
first still holds (the same worker program), as do the exit statuses and the denial of user namespaces;
what does not: concurrent executions on different workers share the host's filesystem and /proc, so
unless the pool runs as root (then each worker's code has a uid of its own and a 0700 run directory) one
can read another's run directory and, same uid, its process's memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import queue
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Literal

import tenacity

from factory.envs import sandbox_confine, sandbox_worker
from factory.envs.sandbox_isolation import (
    REF_PROC,
    IsolationUnavailable,
    _bwrap_prefix,
    _Cgroup,
    _Cgroups,
    _probe_bwrap,
    _python_layout,
    _world_readable,
)
from factory.envs.sandbox_types import LIMIT_MAX, ExecResult, SandboxLimits, SandboxRequestError, _check_request
from factory.envs.sandbox_worker import _HEADER, _body_frame, _recv, _recv_result, _send, _write_all
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
_REPLY_GRACE_S = 10.0  # the host waits wall_s + this for a reply before it declares the worker hung
# A worker whose cgroup holds this much more memory after an execution than after its start is replaced: something
# the execution made outlives it (page cache of the files it read stays charged too, hence the margin).
_LEFTOVER_MEMORY_MB = 64


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




def _module_source(module: Any) -> str:
    """A worker module's text: the worker runs sandbox_worker.py's with `python -I -S -c` and gets
    sandbox_confine.py's as an argument (both import only the stdlib)."""
    with open(module.__file__, encoding="utf-8") as f:
        return f.read()


_TMP_PREFIX = "factory-sandbox-"


def _remove_stale_tmpdirs() -> None:
    """Scratch dirs left by pools whose process died without closing them (killed, or power cut)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            pid = entry.name[len(_TMP_PREFIX):].split("-", 1)[0]
            if entry.name.startswith(_TMP_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                shutil.rmtree(entry.path, ignore_errors=True)


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cold_starts = self.failures = self.recycled = self.executions = self.busy = 0
        self.cold_start_s: list[float] = []
        # Executions that left something behind, by kind (sandbox_confine.leftovers, and the worker's checks), and
        # the workers replaced because what was left could reach a later execution.
        self.leftovers = self.recycled_for_leftovers = 0
        self.leftover_kinds: dict[str, int] = {}
        self.per_execution: set[str] = set()  # what each started worker gives an execution of its own


def _reason(r: dict[str, Any], limits: SandboxLimits, oom_killed: bool) -> str:
    if r.get("fault") and r["exit_code"] is None and r["signal"] is None:
        return f"sandbox fault: {r['fault']}"
    if r["timed_out"]:
        return f"timeout after {limits.wall_s} s"
    if r["truncated"]:
        return f"output over {limits.output_bytes} bytes"
    if oom_killed or r.get("memory_error"):
        return f"memory limit ({limits.memory_mb} MB)"
    sig = r["signal"]
    if sig == "SIGXCPU":
        return f"CPU time limit ({limits.cpu_s} s)"
    if sig == "SIGXFSZ":
        return f"file size limit ({limits.file_size_mb} MB)"
    if sig is not None:
        return f"killed by {sig}"
    if r["exit_code"] != 0:
        return f"exit code {r['exit_code']}"
    return ""


def _failed(reason: str, wall_s: float = 0.0) -> ExecResult:
    return ExecResult(ok=False, exit_code=None, stdout="", stderr="", timed_out=False, killed_by=None,
                      truncated=False, reason=reason, wall_s=wall_s)


class Sandbox:
    """One warm worker. Use it from one thread at a time (the pool hands it to one holder)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None, limits: SandboxLimits,
                 stats: _Stats, cgroup: _Cgroup | None = None, log_path: str | None = None, name: str = ""):
        self.name = name
        self.limits = limits
        self.uses = 0
        self.fault: str | None = None  # why this worker must be recycled, once something went wrong
        self._argv, self._env, self._cwd = argv, env, cwd
        self._stats, self._cgroup, self._log_path = stats, cgroup, log_path
        self._cgroup_limits: SandboxLimits | None = None
        self._proc: subprocess.Popen | None = None
        self.fresh = False  # each execution in namespaces of its own (the worker says so when it starts)
        self.why_not_fresh: str | None = None
        self.dirty: list[str] = []  # what the last execution left where a later one could reach it
        self._memory_start: int | None = None  # the cgroup's memory once the worker is ready

    @property
    def pid(self) -> int | None:
        """The worker's outermost process (bwrap's, under isolation='bwrap')."""
        return self._proc.pid if self._proc else None

    def start(self, timeout: float = 30.0) -> float:
        """Start the worker and wait until it answers; seconds it took."""
        t0 = time.perf_counter()
        argv = self._argv
        if self._cgroup is not None:
            self._set_cgroup_limits(self.limits)
            # Join the cgroups before bwrap starts, so every process of the sandbox is born in them.
            joins = " && ".join(f"echo $$ > {shlex.quote(p)}" for p in self._cgroup.procs_files)
            argv = ["/bin/sh", "-c", f'{joins} && exec "$@"', "sh", *argv]
        stderr = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                          env=self._env, cwd=self._cwd, start_new_session=True)
        finally:
            if stderr is not subprocess.DEVNULL:
                stderr.close()
        try:
            msg = _recv(self._proc.stdout.fileno(), time.monotonic() + timeout)
        except (TimeoutError, ValueError, OSError) as e:
            self.kill()
            raise RuntimeError(f"sandbox worker did not start: {e}{self._log_tail()}") from e
        if msg is None or msg.get("op") != "ready":
            self.kill()
            raise RuntimeError(f"sandbox worker did not start (exit code {self._proc.wait()}){self._log_tail()}")
        self.fresh, self.why_not_fresh = bool(msg.get("fresh")), msg.get("why_not_fresh")
        if self._cgroup is not None:
            self._memory_start = self._cgroup.memory_bytes()
        return time.perf_counter() - t0

    def _log_tail(self) -> str:
        if not self._log_path:
            return ""
        try:
            with open(self._log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self._log_path) - 2000))
                tail = f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""
        return f"; worker stderr: {tail}" if tail else ""

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.fault is None

    def ping(self, timeout: float = 5.0) -> bool:
        """True if the worker answers; a worker that does not is marked faulty."""
        if not self.alive():
            return False
        try:
            _send(self._proc.stdin.fileno(), {"op": "ping"})
            msg = _recv(self._proc.stdout.fileno(), time.monotonic() + timeout)
        except (OSError, TimeoutError, ValueError) as e:
            self.fault = f"ping failed: {type(e).__name__}: {e}"
            return False
        if msg is None or msg.get("op") != "pong":
            self.fault = "ping: worker gone" if msg is None else f"ping: unexpected reply {msg.get('op')!r}"
            return False
        return True

    def exec(self, code: str, stdin: str = "", files: dict[str, str] | None = None,
             limits: SandboxLimits | None = None) -> ExecResult:
        """Run code once. Never raises for anything the code does; a worker fault gives ok=False and
        marks this sandbox for recycling. SandboxRequestError (a ValueError) for the caller's mistakes: bad `files`
        names, text that is not Unicode."""
        _check_request(code, stdin, files)
        limits = limits or self.limits
        if not self.alive():
            self.fault = self.fault or "worker not running"
            return _failed(f"sandbox fault: {self.fault}")
        self.uses += 1
        with self._stats.lock:
            self._stats.executions += 1
        oom_before = 0
        if self._cgroup is not None:
            if limits != self._cgroup_limits:
                self._set_cgroup_limits(limits)
            oom_before = self._cgroup.oom_kills()
        # Two frames: the worker reads the first, only the execution's own process the second (sandbox_worker.py).
        control = json.dumps({"op": "exec", "limits": dataclasses.asdict(limits)}).encode()
        frames = _HEADER.pack(len(control)) + control + _body_frame(code, stdin, files or {})
        t0 = time.monotonic()
        try:
            _write_all(self._proc.stdin.fileno(), frames)
            r = _recv_result(self._proc.stdout.fileno(), t0 + limits.wall_s + _REPLY_GRACE_S)
        except TimeoutError:
            self.fault = "worker hung (no reply past the wall timeout)"
            self.kill()
            return _failed(f"sandbox fault: {self.fault}", time.monotonic() - t0)
        except (OSError, ValueError) as e:
            self.fault = f"protocol error: {type(e).__name__}: {e}"
            self.kill()
            return _failed(f"sandbox fault: {self.fault}", time.monotonic() - t0)
        if r is None:
            # The worker died under the code (e.g. it killed its parent): recycle, score the run 0.
            self.fault = "worker died during the run"
            self.kill()
            return _failed("sandbox worker died during the run (the code may have killed it)", time.monotonic() - t0)
        if r.get("op") != "result":
            self.fault = f"unexpected reply {r.get('op')!r}"
            self.kill()
            return _failed(f"sandbox fault: {self.fault}", time.monotonic() - t0)
        if r.get("fault"):
            self.fault = r["fault"]
        oom = self._cgroup is not None and self._cgroup.oom_kills() > oom_before
        reason = _reason(r, limits, oom)
        leftovers = self._leftovers(r)
        return ExecResult(ok=reason == "", exit_code=r["exit_code"], stdout=r["stdout"], stderr=r["stderr"],
                          timed_out=r["timed_out"], killed_by=r["signal"], truncated=r["truncated"], reason=reason,
                          wall_s=float(r["wall_s"]), leftovers=leftovers)

    def _leftovers(self, r: dict[str, Any]) -> dict[str, int]:
        """What the execution left (the worker's report, and memory still charged to the cgroup); marks this
        worker dirty when a later execution could reach any of it, and counts it all in the pool's stats."""
        leftovers = {str(k): int(v) for k, v in (r.get("leftovers") or {}).items()}
        self.dirty = [str(k) for k in r.get("dirty") or []]
        if self._memory_start is not None:
            grown = (self._cgroup.memory_bytes() or 0) - self._memory_start
            if grown > _LEFTOVER_MEMORY_MB << 20:
                leftovers["memory_mb"] = grown >> 20
                self.dirty.append("memory_mb")
        if leftovers:
            with self._stats.lock:
                self._stats.leftovers += 1
                for kind in leftovers:
                    if not kind.endswith("_bytes"):
                        self._stats.leftover_kinds[kind] = self._stats.leftover_kinds.get(kind, 0) + 1
        return leftovers

    def _set_cgroup_limits(self, limits: SandboxLimits) -> None:
        try:
            self._cgroup.set_limits(limits)
            self._cgroup_limits = limits
        except OSError as e:
            log.warning("sandbox %s: could not set cgroup limits (%s); RLIMIT_AS still applies", self.name, e)

    def kill(self) -> None:
        """Stop the worker now (its namespace and everything in it go with bwrap)."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self._proc.kill()
        for f in (self._proc.stdin, self._proc.stdout):
            with contextlib.suppress(OSError):
                f.close()

    def reap(self) -> None:
        """Wait for the killed worker and remove its cgroup (slow-ish; the pool does it in the background)."""
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
        if self._cgroup is not None:
            self._cgroup.remove()
        if self._cwd:
            shutil.rmtree(self._cwd, ignore_errors=True)
        if self._log_path:
            with contextlib.suppress(OSError):
                os.unlink(self._log_path)


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
        self._source, self._confine_source = _module_source(sandbox_worker), _module_source(sandbox_confine)
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
        return [*self._prefix, self._layout.executable, "-I", "-S", "-c", self._source, json.dumps(cfg),
                self._confine_source]

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

