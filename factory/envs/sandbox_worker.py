"""The sandbox worker's program: a fork server that runs one execution at a time, and the framing it speaks.

The pool (`sandbox.py`) runs this whole file with `python -I -S -c`, inside bubblewrap when isolated
(`sandbox_isolation.py`), so it imports only the standard library. Per execution the worker compiles the
code (when small), forks a child that drops privileges, sets rlimits, makes a fresh private directory,
runs the code with `exec()` as `__main__` and exits. The worker reads the child's stdout and stderr (capped
at `output_bytes`, the code killed past it), kills it at the wall timeout, then kills whatever it left
behind and wipes its files, so one execution never sees another's.

Host and worker talk over the worker's stdin/stdout: 4-byte big-endian length, then UTF-8 JSON
(`_send`/`_recv`, used on both sides). Requests: {"op": "ping"} -> {"op": "pong"}; {"op": "exec", "code",
"stdin", "files", "limits"} -> {"op": "result", "exit_code", "signal", "timed_out", "truncated", "stdout",
"stderr", "memory_error", "wall_s", "fault"}. The first message is {"op": "ready"}.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import math
import os
import resource
import select
import signal
import struct
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Iterator
from typing import Any

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
        _write_all(stdin_fd, req.get("stdin", "").encode("utf-8", "surrogateescape"))
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




if __name__ == "__main__":  # the pool runs this file's text with `python -c`, the config in argv[1]
    _worker_main(sys.argv[1:])
