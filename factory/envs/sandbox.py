"""The sandbox pool: the only place generated code runs. It owns warm, isolated workers and their limits.

A `SandboxPool` keeps `size` warm workers. Each worker is a long-lived Python process (a fork server)
started inside bubblewrap, with a few modules preloaded; per execution it compiles the code (when
small), forks a child that drops privileges, sets rlimits, makes a fresh private directory, runs the
code with `exec()` as `__main__` and exits. The worker reads the child's stdout and stderr (capped at
`output_bytes`, the code killed past it), kills it at the wall timeout, then kills whatever it left
behind and wipes its files, so one execution never sees another's. Host and worker talk over the
worker's stdin/stdout: 4-byte big-endian length, then UTF-8 JSON. A worker is recycled after
`recycle_after` runs or any fault (it died, hung, broke the protocol, could not kill or clean up after
the code) and replaced in the background; `acquire()` pings the worker it lends.

Isolation (`isolation="bwrap"`): new mount, pid, net, ipc and uts namespaces; a read-only root with
read-only /usr (+ the /bin, /lib* links), a few /etc files and the interpreter's installation; private
size-bounded tmpfs /tmp and /dev/shm (the only writable places); fresh /proc and minimal /dev; a
scrubbed environment (PATH, HOME=/tmp, LANG). The repo, FACTORY_HOME, /root and the host's loopback
are not reachable. The code sees the standard library only (`python -I -S`, the interpreter behind
`python`, e.g. a venv's base). How the code is kept from the worker depends on who runs the pool:

- as root, bwrap runs privileged (no user namespace) with only CAP_SETUID/CAP_SETGID kept; each child
  switches to a random unprivileged uid of its own. RLIMIT_NPROC then binds (the kernel does not apply
  it to uid 0, even inside a user namespace: measured here), and the code can neither signal the worker
  nor open its pipes through /proc.
- otherwise bwrap makes a user namespace; the child keeps the worker's uid, so code that kills its
  worker gets the worker recycled (the worker is non-dumpable, so its pipes stay out of reach).

Memory: RLIMIT_AS per process always; where this process may create cgroups (v2 with the memory
controller delegated, or v1 memory/pids hierarchies) each worker also gets its own cgroup with a
memory and pids limit, which bounds the sum over all processes of an execution. `metrics()["memory_limit"]`
says which applies.

`isolation="none"` runs workers as plain processes (rlimits, timeouts and, as root, the uid switch still
apply) and logs a WARNING once: untrusted code is then not isolated from the host.

This module is also the worker's program: the pool runs the slice between the "worker: begin/end"
markers with `python -I -S -c`, so the module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import importlib
import json
import logging
import math
import os
import queue
import random
import resource
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("factory.envs.sandbox")

# Modules the worker imports before it forks, so the code's own imports of them cost nothing. Each costs
# cold-start time (unittest ~15 ms, dataclasses ~8 ms); SandboxPool(preload=...) picks others.
PRELOAD = ("collections", "functools", "itertools", "math", "re", "json", "string", "heapq", "bisect")

_REPLY_GRACE_S = 10.0  # the host waits wall_s + this for a reply before it declares the worker hung
_CGROUP_OVERHEAD_MB = 64  # the worker and bwrap themselves, on top of the code's memory limit
_CGROUP_PREFIX = "factory-sandbox-"


@dataclass(frozen=True)
class SandboxLimits:
    """Per-execution limits. cpu_s: RLIMIT_CPU (SIGXCPU); wall_s: the worker kills the code's processes;
    memory_mb: RLIMIT_AS per process (and the worker's cgroup where available); processes: RLIMIT_NPROC;
    file_size_mb: RLIMIT_FSIZE; open_files: RLIMIT_NOFILE; output_bytes: cap on stdout and on stderr."""

    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    processes: int = 64
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"SandboxLimits.{f.name} must be > 0, got {getattr(self, f.name)!r}")


@dataclass
class ExecResult:
    """What one execution did. ok: exit 0, no timeout, not killed, output not truncated."""

    ok: bool
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_by: str | None  # signal name, e.g. "SIGKILL", "SIGXCPU"
    truncated: bool  # stdout or stderr went over output_bytes (the code was then killed)
    reason: str  # "" when ok, else a short human reason
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecResult:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


class IsolationUnavailable(RuntimeError):
    """bubblewrap (or the namespaces it needs) is not usable here; the message says why."""


# === worker: begin ======================================================================================
# From here to "worker: end", the worker's program: the pool runs this slice with `python -I -S -c`,
# after _WORKER_IMPORTS. Framing is shared with the host side.

_HEADER = struct.Struct(">I")
_MAX_MESSAGE = 256 << 20  # a request or reply larger than this is a protocol error

# prctl(2) options (linux/prctl.h); ctypes because the stdlib has no prctl.
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38

_KILL_WAIT_S = 2.0  # a SIGKILLed process not gone after this is "a child it could not kill": recycle
_DRAIN_S = 1.0  # after the code's process exits, how long its pipes may stay open (held by leftovers)
_COMPILE_HERE_MAX = 32 << 10  # code up to this many characters is compiled by the worker, before the fork


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _send(fd: int, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    _write_all(fd, _HEADER.pack(len(body)) + body)


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd; None on EOF; TimeoutError past the deadline (None: wait forever)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError("no reply from the sandbox worker")
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _recv(fd: int, deadline: float | None = None) -> dict[str, Any] | None:
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    (n,) = _HEADER.unpack(header)
    if n > _MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes is over the {_MAX_MESSAGE} byte limit")
    body = _read_exact(fd, n, deadline)
    if body is None:
        return None
    msg = json.loads(body)
    if not isinstance(msg, dict):
        raise ValueError("message is not a JSON object")
    return msg


class _Worker:
    """The fork server. cfg: scratch (where run dirs go), wipe (dirs emptied after each run), drop_uid
    (uid the code runs as, when the worker is root), pidns (alone in a pid namespace), preload."""

    def __init__(self, cfg: dict[str, Any]):
        self.scratch: str = cfg["scratch"]
        self.wipe: list[str] = cfg["wipe"]
        self.uid: int | None = cfg.get("drop_uid")
        self.pidns: bool = cfg["pidns"]
        self.runs = 0
        self.libc = ctypes.CDLL(None, use_errno=True)
        # Non-dumpable: the code (same uid in user-namespace mode) can neither ptrace us nor open our pipes
        # through /proc/<pid>/fd to forge a reply.
        self.libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        for name in cfg.get("preload", ()):
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        # The code's stdio, made once: after each child dup2s its pipes onto fds 0-2, these wrap them
        # (making three text streams in the child costs it ~0.4 ms of copy-on-write faults).
        self.stdio = (open(0, encoding="utf-8", errors="surrogateescape", closefd=False),  # noqa: SIM115
                      open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False),  # noqa: SIM115
                      open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False))  # noqa: SIM115
        # Everything alive now is never collected: a collection in a child would touch (and so copy)
        # every page of the fork server's heap.
        gc.freeze()
        if self.uid is not None:
            for d in self.wipe:
                os.chmod(d, 0o1777)  # the code's uid creates its run dir here; sticky: nobody else's files

    def serve(self) -> None:
        _send(1, {"op": "ready", "pid": os.getpid()})
        while True:
            req = _recv(0)
            if req is None:
                return  # the host closed our stdin: it is gone or retired us
            op = req.get("op")
            if op == "ping":
                _send(1, {"op": "pong", "runs": self.runs})
            elif op == "exec":
                _send(1, self.execute(req))
            else:
                _send(1, {"op": "error", "error": f"unknown op {op!r}"})

    # -- one execution -----------------------------------------------------------------------------------

    def execute(self, req: dict[str, Any]) -> dict[str, Any]:
        self.runs += 1
        lim = req["limits"]
        run_dir = os.path.join(self.scratch, f"run-{self.runs}")
        compiled = None
        if len(req["code"]) <= _COMPILE_HERE_MAX:
            # Compiling in a fresh child costs ~1 ms of copy-on-write faults (the compiler touches much of
            # the heap); here it is ~20 us. Only small code: a long compile would run outside the limits.
            with contextlib.suppress(Exception), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                compiled = compile(req["code"], "main.py", "exec", dont_inherit=True)
            if caught:
                compiled = None  # an error or a SyntaxWarning: the child compiles again and reports like python
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the code's process: never returns
            try:
                self._child(req, compiled, lim, run_dir, out_w, err_w, (out_r, err_r))
            except BaseException:  # noqa: BLE001 - report setup failures as the code's stderr
                with contextlib.suppress(Exception):
                    os.write(2, ("sandbox setup failed: " + traceback.format_exc()).encode())
            finally:
                os._exit(126)
        os.close(out_w)
        os.close(err_w)
        res = self._supervise(pid, out_r, err_r, lim, t0)
        res["op"] = "result"
        return res

    def _supervise(self, pid: int, out_r: int, err_r: int, lim: dict[str, Any], t0: float) -> dict[str, Any]:
        cap = int(lim["output_bytes"])
        bufs = {out_r: bytearray(), err_r: bytearray()}
        open_fds = [out_r, err_r]
        pidfd = os.pidfd_open(pid)
        end = t0 + float(lim["wall_s"])
        drain_end = None
        exited = timed_out = truncated = swept = False
        wall = None
        try:
            while open_fds or not exited:
                now = time.monotonic()
                limit = drain_end if exited else end
                if now >= limit:
                    timed_out = not exited
                    break
                watch = [*open_fds, 0] if exited else [*open_fds, pidfd, 0]
                ready, _, _ = select.select(watch, [], [], limit - now)
                if 0 in ready:  # the host never writes during a run: this is EOF, the host is gone
                    self._sweep(pid)
                    os._exit(0)
                for fd in ready:
                    if fd in bufs:
                        data = os.read(fd, 1 << 16)
                        if not data:
                            open_fds.remove(fd)
                            continue
                        room = cap - len(bufs[fd])
                        bufs[fd] += data[:room]
                        truncated = truncated or len(data) > room
                if truncated:
                    break
                if pidfd in ready and not exited:
                    exited, wall = True, time.monotonic() - t0
                    # The code is done: kill what it left behind, which also closes the pipes it holds.
                    self._sweep(pid)
                    swept, drain_end = True, time.monotonic() + _DRAIN_S
            if wall is None:
                wall = time.monotonic() - t0
            if not swept:  # one sweep suffices: a process forking while kill(-1) runs has its fork fail
                self._sweep(pid)
            fault = None
            if not select.select([pidfd], [], [], _KILL_WAIT_S)[0]:
                fault = "could not kill the code's process"
                status = None
            else:
                status = os.waitpid(pid, 0)[1]
        finally:
            for fd in (out_r, err_r, pidfd):
                os.close(fd)
        if fault is None and self.pidns and not self._namespace_empty(_KILL_WAIT_S):
            fault = "processes survived the kill"
        try:
            self._wipe_all()
        except Exception as e:  # noqa: BLE001 - a tree the code made unremovable: recycle the worker
            fault = fault or f"could not wipe the run's files: {type(e).__name__}: {e}"
        exit_code = sig = None
        if status is not None:
            if os.WIFSIGNALED(status):
                sig = _signal_name(os.WTERMSIG(status))
            else:
                exit_code = os.waitstatus_to_exitcode(status)
        return {"exit_code": exit_code, "signal": sig, "timed_out": timed_out, "truncated": truncated,
                "stdout": bufs[out_r].decode("utf-8", "replace"), "stderr": bufs[err_r].decode("utf-8", "replace"),
                "memory_error": exit_code not in (None, 0) and b"MemoryError" in bytes(bufs[err_r][-2048:]),
                "wall_s": wall, "fault": fault}

    def _child(self, req: dict[str, Any], compiled: types.CodeType | None, lim: dict[str, Any], run_dir: str,
               out_w: int, err_w: int, inherited: tuple[int, ...]) -> None:
        os.setsid()  # own session and process group: the worker kills the group
        for fd in inherited:
            os.close(fd)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        if self.uid is not None:
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)  # all capabilities go with uid 0
        self.libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # dies with its worker (after setuid: it resets it)
        self.libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no setuid binary or file capability raises it
        self.libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc entries stay usable to the code
        # Files through os.open/os.write: a text file object costs this fresh child ~0.15 ms of faults.
        with contextlib.suppress(OSError):  # under a memory cgroup, the OOM killer takes the code, not us
            _write_file("/proc/self/oom_score_adj", "1000", os.O_WRONLY)
        os.mkdir(run_dir, 0o700)
        files = req.get("files") or {}
        for name, text in files.items():
            path = os.path.join(run_dir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write_file(path, text)
        code = req["code"]
        if "main.py" not in files:
            _write_file(os.path.join(run_dir, "main.py"), code)  # for tracebacks' source lines
        os.chdir(run_dir)
        stdin_fd = os.memfd_create("stdin")  # no pipe to deadlock on, no file for the code to find
        _write_all(stdin_fd, req.get("stdin", "").encode())
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        os.closerange(3, 1 << 16)
        mb = 1 << 20
        cpu = max(1, math.ceil(float(lim["cpu_s"])))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (int(lim["memory_mb"]) * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (int(lim["processes"]),) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(lim["file_size_mb"]) * mb,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(lim["open_files"]),) * 2)
        _run_as_main(code, compiled, run_dir, self.stdio)

    # -- cleanup -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _as_code_uid(self) -> Iterator[None]:
        """Effective uid of the code (real and saved stay 0): we may signal and delete what it made."""
        if self.uid is None:
            yield
            return
        os.seteuid(self.uid)
        try:
            yield
        finally:
            os.seteuid(0)

    def _sweep(self, pid: int) -> None:
        """SIGKILL the code's process group and everything else the code started."""
        with self._as_code_uid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            if self.pidns:
                # kill(-1) reaches every process of ours in the namespace but ourselves and pid 1 (bwrap's
                # init): also the ones that left the group with setsid.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(-1, signal.SIGKILL)
        if not self.pidns and self.uid is not None:
            # Not in a pid namespace: kill(-1) must come from a process whose real uid is the code's, or
            # it would reach every root process on the host. A helper that is wholly that uid does it.
            helper = os.fork()
            if helper == 0:
                try:
                    os.setresuid(self.uid, self.uid, self.uid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(helper, 0)

    def _namespace_empty(self, timeout: float) -> bool:
        me, end = os.getpid(), time.monotonic() + timeout
        while True:
            if not [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)  # killed processes are being torn down and reaped by pid 1; no event for it

    def _wipe_all(self) -> None:
        with self._as_code_uid():
            for root in self.wipe:
                for name in os.listdir(root):
                    _remove_tree(os.path.join(root, name))


def _write_file(path: str, text: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, text.encode("utf-8", "surrogateescape"))
    finally:
        os.close(fd)


def _remove_tree(path: str) -> None:
    """Remove a tree the code made, whatever modes it set on it (we are its owner)."""
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    os.chmod(path, 0o700)
    for name in os.listdir(path):
        _remove_tree(os.path.join(path, name))
    os.rmdir(path)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _run_as_main(code: str, compiled: types.CodeType | None, run_dir: str, stdio: tuple) -> None:
    """Run code like `python main.py` would, in this (forked) process, and exit with its status."""
    sys.stdin, sys.stdout, sys.stderr = stdio
    main = types.ModuleType("__main__")
    main.__file__ = os.path.join(run_dir, "main.py")
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    sys.path[0] = run_dir
    status = 0
    try:
        if compiled is None:  # dont_inherit: not this module's `from __future__ import annotations`
            compiled = compile(code, "main.py", "exec", dont_inherit=True)
        exec(compiled, main.__dict__)  # noqa: S102 - the point of the sandbox
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:  # noqa: BLE001 - an uncaught exception: traceback and status 1, like python
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this function's frame
        status = 1
    try:
        threading._shutdown()  # wait for non-daemon threads, as interpreter exit does
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    with contextlib.suppress(Exception):
        print(e.code, file=sys.stderr)
    return 1


def _worker_main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C on the host's terminal is the host's business
    _Worker(json.loads(argv[0])).serve()


# === worker: end ========================================================================================

# ---------------------------------------------------------------------------------------------------------
# Host side


_WARNED_UNISOLATED = False
_PROBES: dict[tuple, str | None] = {}  # (bwrap argv prefix) -> None if it works, else why not
_probe_lock = threading.Lock()


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


def _world_readable(path: str) -> bool:
    """Whether any uid may read path and reach it (o+rx on it and o+x on every directory above)."""
    p = Path(path)
    try:
        return (p.stat().st_mode & 0o005) == 0o005 and all(q.stat().st_mode & 0o001 for q in p.parents)
    except OSError:
        return False


@dataclass(frozen=True)
class _PythonLayout:
    executable: str  # the real interpreter binary (a venv's python resolves to its base)
    base_prefix: str


def _python_layout(python: str) -> _PythonLayout:
    exe = os.path.realpath(python)
    if exe == os.path.realpath(sys.executable):
        return _PythonLayout(exe, sys.base_prefix)
    out = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                         text=True, timeout=60, check=True)
    return _PythonLayout(exe, out.stdout.strip())


# What the worker slice imports (keep in step with it; a worker that fails to start says which name).
_WORKER_IMPORTS = ("from __future__ import annotations\n"
                   "import contextlib, ctypes, gc, importlib, json, math, os, resource, select, signal, struct, sys, "
                   "threading, time, traceback, types, warnings\n"
                   "from collections.abc import Iterator\nfrom typing import Any\n")


def _worker_source() -> str:
    with open(__file__, encoding="utf-8") as f:
        text = f.read()
    begin, end = text.index("# === worker: begin"), text.index("# === worker: end")
    return _WORKER_IMPORTS + text[begin:end] + "\n_worker_main(sys.argv[1:])\n"


def _bwrap_prefix(bwrap: str, layout: _PythonLayout, privileged: bool, tmp_mb: int) -> list[str]:
    """bubblewrap's arguments up to the command. privileged: we are root, so no user namespace (see the
    module docstring) and only the capabilities the worker needs to switch the code to its own uid."""
    a = [bwrap]
    if privileged:
        a += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        a += ["--unshare-all", "--unshare-user"]
    a += ["--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            a += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            a += ["--ro-bind", top, top]
    # Minimal /etc: the dynamic loader's cache, the time zone, and the alternatives /usr/bin links into.
    for f in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives"):
        a += ["--ro-bind-try", f, f]
    binds = sorted(p for p in {layout.base_prefix, os.path.dirname(os.path.dirname(layout.executable))}
                   if not p.startswith("/usr/"))
    # bwrap gives the directories it creates above a bind their host modes; a 0700 /root above a pyenv
    # install would leave the code (its own uid) unable to import anything the worker had not preloaded.
    parents = sorted({str(q) for p in binds for q in Path(p).parents if str(q) != "/"}, key=len)
    for d in parents:
        a += ["--perms", "0755", "--dir", d]
    for p in binds:
        a += ["--ro-bind", p, p]
    size = str(tmp_mb << 20)
    a += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev",
          "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
          # Only /tmp and /dev/shm stay writable (and are wiped after each run); in a user namespace the code
          # would otherwise own the sandbox's root and /dev, and could leave files there for the next run.
          "--remount-ro", "/dev", "--remount-ro", "/",
          "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
          "--setenv", "LANG", "C.UTF-8", "--chdir", "/tmp"]
    return a


def _probe_bwrap(prefix: list[str], exe: str) -> None:
    key = tuple(prefix) + (exe,)
    with _probe_lock:
        if key not in _PROBES:
            try:
                p = subprocess.run([*prefix, exe, "-I", "-S", "-c", "pass"], capture_output=True, text=True,
                                   timeout=60)
                why = None if p.returncode == 0 else (p.stderr.strip() or f"exit code {p.returncode}")
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"{type(e).__name__}: {e}"
            _PROBES[key] = why
        why = _PROBES[key]
    if why is not None:
        raise IsolationUnavailable(
            f"bubblewrap cannot start a sandbox here: {why}. It needs the bubblewrap package and, unless run as "
            f"root, unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            f"user.max_user_namespaces > 0; inside a container, one that allows them). isolation='none' runs "
            f"without isolation.")


class _Cgroup:
    """One worker's cgroups: a memory (and, where possible, pids) limit over all its processes."""

    def __init__(self, kind: str, dirs: dict[str, str]):
        self.kind, self.dirs = kind, dirs  # controller ("memory", "pids") -> directory

    @property
    def procs_files(self) -> list[str]:
        return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

    def set_limits(self, limits: SandboxLimits) -> None:
        memory = (limits.memory_mb + _CGROUP_OVERHEAD_MB) << 20
        pids = limits.processes + 8  # + the worker, bwrap's init and a sweep helper
        if self.kind == "cgroup-v2":
            _write(os.path.join(self.dirs["memory"], "memory.max"), memory)
            with contextlib.suppress(OSError):
                _write(os.path.join(self.dirs["memory"], "memory.swap.max"), 0)
        else:
            _write(os.path.join(self.dirs["memory"], "memory.limit_in_bytes"), memory)
        if "pids" in self.dirs:
            _write(os.path.join(self.dirs["pids"], "pids.max"), pids)

    def oom_kills(self) -> int:
        name = "memory.events" if self.kind == "cgroup-v2" else "memory.oom_control"
        try:
            with open(os.path.join(self.dirs["memory"], name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, timeout: float = 2.0) -> None:
        end = time.monotonic() + timeout
        for d in set(self.dirs.values()):
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # still has dying processes
                    if time.monotonic() >= end:
                        log.debug("could not remove cgroup %s", d)
                        break
                    time.sleep(0.01)  # processes leave a cgroup asynchronously after SIGKILL; bounded


def _write(path: str, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


class _Cgroups:
    """Where this process may create per-worker cgroups with a memory limit; `detect()` is None elsewhere."""

    def __init__(self, kind: str, parents: dict[str, str]):
        self.kind, self.parents = kind, parents

    @classmethod
    def detect(cls, root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> _Cgroups | None:
        try:
            with open(self_cgroup) as f:
                lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        except OSError:
            return None
        if os.path.exists(os.path.join(root, "cgroup.controllers")):  # v2 (unified)
            path = next((p for i, c, p in lines if i == "0"), None)
            if path is None:
                return None
            parent = os.path.join(root, path.lstrip("/"))
            probe = cls._probe(parent, ["memory.max"])
            if probe is None:
                return None
            parents = {"memory": parent}
            if "pids.max" in probe:
                parents["pids"] = parent
            return cls("cgroup-v2", parents)
        parents = {}
        for _, controllers, path in lines:
            for c in controllers.split(","):
                if c in ("memory", "pids"):
                    d = os.path.join(root, c, path.lstrip("/"))
                    if cls._probe(d, ["memory.limit_in_bytes" if c == "memory" else "pids.max"]) is not None:
                        parents[c] = d
        return cls("cgroup-v1", parents) if "memory" in parents else None

    @staticmethod
    def _probe(parent: str, need: list[str]) -> set[str] | None:
        """Files a new child cgroup of parent has, if we may make one that has all of `need`."""
        d = os.path.join(parent, f"{_CGROUP_PREFIX}probe-{os.getpid()}")
        try:
            os.mkdir(d)
        except OSError:
            return None
        try:
            names = set(os.listdir(d))
            return names if all(n in names for n in need) else None
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(d)

    def create(self, name: str) -> _Cgroup:
        dirs = {}
        for c, parent in self.parents.items():
            d = os.path.join(parent, _CGROUP_PREFIX + name)
            os.makedirs(d, exist_ok=True)
            dirs[c] = d
        return _Cgroup(self.kind, dirs)

    def remove_stale(self) -> None:
        """Empty cgroups left by pools of processes that have died."""
        for parent in set(self.parents.values()):
            with contextlib.suppress(OSError):
                for name in os.listdir(parent):
                    pid = name[len(_CGROUP_PREFIX):].split("-", 1)[0]
                    if name.startswith(_CGROUP_PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                        with contextlib.suppress(OSError):
                            os.rmdir(os.path.join(parent, name))


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


def _check_files(files: dict[str, str] | None) -> None:
    for name, text in (files or {}).items():
        norm = os.path.normpath(name) if isinstance(name, str) else ""
        if (not norm or norm in (".", "..") or os.path.isabs(name) or norm.startswith("../") or "\0" in name
                or not isinstance(text, str)):
            raise ValueError(f"files: bad file name {name!r} (want a relative path inside the run directory "
                             f"mapped to its text)")


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
        marks this sandbox for recycling. ValueError for bad `files` names (the caller's mistake)."""
        _check_files(files)
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
        req = {"op": "exec", "code": code, "stdin": stdin, "files": files or {}, "limits": dataclasses.asdict(limits)}
        t0 = time.monotonic()
        try:
            _send(self._proc.stdin.fileno(), req)
            r = _recv(self._proc.stdout.fileno(), t0 + limits.wall_s + _REPLY_GRACE_S)
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
        return ExecResult(ok=reason == "", exit_code=r["exit_code"], stdout=r["stdout"], stderr=r["stderr"],
                          timed_out=r["timed_out"], killed_by=r["signal"], truncated=r["truncated"], reason=reason,
                          wall_s=float(r["wall_s"]))

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


class SandboxPool:
    """`size` warm sandboxes; see the module docstring. Thread-safe: many threads may `run()` at once.

    Extra keyword arguments: bwrap (the bubblewrap executable, name or path), cgroups (use per-worker
    cgroups where this process may create them), startup_timeout (seconds for a worker to answer),
    preload (modules each worker imports before it forks; default PRELOAD).
    """

    def __init__(self, size: int = 4, isolation: Literal["bwrap", "none"] = "bwrap",
                 limits: SandboxLimits = SandboxLimits(), recycle_after: int = 100, python: str = sys.executable,  # noqa: B008
                 *, bwrap: str = "bwrap", cgroups: bool = True, startup_timeout: float = 30.0,
                 preload: tuple[str, ...] = PRELOAD):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if recycle_after < 1:
            raise ValueError(f"recycle_after must be >= 1, got {recycle_after}")
        if isolation not in ("bwrap", "none"):
            raise ValueError(f"isolation must be 'bwrap' or 'none', got {isolation!r}")
        self.size, self.isolation, self.limits, self.recycle_after = size, isolation, limits, recycle_after
        self.startup_timeout, self.preload = startup_timeout, tuple(preload)
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
        self._source = _worker_source()
        # Workers are spawned from these long-lived threads only: bwrap --die-with-parent ties a worker to
        # the thread that forked it, so a short-lived caller thread would take its workers with it.
        self._spawner = ThreadPoolExecutor(max_workers=min(size, 4), thread_name_prefix="sandbox-spawn")

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
               "drop_uid": drop_uid, "pidns": sandboxed, "preload": list(self.preload)}
        return [*self._prefix, self._layout.executable, "-I", "-S", "-c", self._source, json.dumps(cfg)]

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
        delay, tries = 0.1, 0
        while not self._closed.is_set():
            tries += 1
            sb = None
            try:
                sb = self._make_sandbox()
                seconds = sb.start(self.startup_timeout)
            except Exception as e:  # noqa: BLE001 - count it, retry, keep the pool going
                with self._stats.lock:
                    self._stats.failures += 1
                self._last_error = f"{type(e).__name__}: {e}"
                log.warning("sandbox worker failed to start (try %d): %s", tries, self._last_error)
                if sb is not None:
                    sb.reap()
                if attempts is not None and tries >= attempts:
                    return False
                self._closed.wait(delay)  # back off before the next try; returns at once on close
                delay = min(delay * 2, 5.0)
                continue
            with self._stats.lock:
                self._stats.cold_starts += 1
                self._stats.cold_start_s.append(seconds)
                del self._stats.cold_start_s[:-1000]
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
        return False

    def _retire(self, sb: Sandbox, fault: bool) -> None:
        """Take sb out of service and start a replacement in the background."""
        with self._lock:
            known = sb in self._live
            self._live.discard(sb)
        with self._stats.lock:
            self._stats.recycled += 1
            self._stats.failures += int(fault)
        if fault:
            log.warning("sandbox worker %s recycled after a fault: %s%s", sb.name, sb.fault or "marked unhealthy",
                        sb._log_tail())
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
        elif sb.uses >= self.recycle_after:
            self._retire(sb, fault=False)
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
        raises for the caller's mistakes (bad file names) and the pool's (closed, none free in 30 s)."""
        _check_files(files)
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
        failures (worker faults and failed starts), recycled (workers retired: after recycle_after uses or
        a fault), executions, plus the isolation, the memory limit mechanism and cold start times."""
        with self._stats.lock:
            s = self._stats
            cold = sorted(s.cold_start_s)
            return {"size": self.size, "warm": self._idle.qsize(), "busy": s.busy, "cold_starts": s.cold_starts,
                    "failures": s.failures, "recycled": s.recycled, "executions": s.executions,
                    "isolation": self.isolation, "memory_limit": self.memory_limit,
                    "code_uid": "own random uid" if self._drop_uid else "worker's uid",
                    "cold_start_p50_ms": round(cold[len(cold) // 2] * 1000, 2) if cold else None}

