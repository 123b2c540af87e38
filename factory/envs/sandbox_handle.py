"""One warm sandbox worker as the pool's host side sees it (`Sandbox`): start it, ping it, run one execution on
it, read what the execution left, kill it. The pool (`sandbox.py`) keeps several and lends them out; the worker's
own side is `sandbox_worker.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from typing import Any

from factory.envs.sandbox_frames import _HEADER, _body_frame, _recv, _recv_result, _send, _write_all
from factory.envs.sandbox_isolation import _Cgroup
from factory.envs.sandbox_types import ExecResult, SandboxLimits, _check_request

log = logging.getLogger("factory.envs.sandbox")  # the pool's: one logger for its messages

_REPLY_GRACE_S = 10.0  # the host waits wall_s + this for a reply before it declares the worker hung
# A worker whose cgroup holds this much more memory after an execution than after its start is replaced: something
# the execution made outlives it (page cache of the files it read stays charged too, hence the margin).
_LEFTOVER_MEMORY_MB = 64


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
