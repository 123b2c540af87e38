"""The sandbox worker's program: a fork server that runs one execution at a time.

The pool (`sandbox.py`) runs this file inside bubblewrap when isolated (`sandbox_isolation.py`) with
`python -I -S -c`, giving it the text of the two modules it imports (`sandbox_frames`, the framing it speaks with
the host; `sandbox_confine`, the executions' namespaces), so all three import only the standard library. At start
(`_start`) the worker makes itself, where the kernel lets it, the fork server of namespaces of its own: pid 1 of
a pid namespace in a user namespace it owns, as the code's uid (see sandbox_confine.py; elsewhere it serves as
it is and the pool gives every execution a fresh worker). Per execution it enters new IPC and mount namespaces
(fresh /tmp, /dev/shm, /dev/mqueue; its own /proc entry covered) and forks the code's process, which reads the
request itself, drops every capability, installs a seccomp filter (no keyrings, no further user namespaces), sets
rlimits, makes its run directory, runs the code with `exec()` as `__main__` and exits. The worker reads its stdout
and stderr (capped at `output_bytes`, the code killed past it), kills it at the wall timeout, then kills whatever
it left behind, counts and removes what it left in IPC, and checks what it left where a later execution could
reach it (the pool then replaces the worker).

Why one execution never sees another's code, inputs, files or outputs: every child is a fork of this
process, so whatever this process's heap ever held, every later execution could read (/proc/self/mem).
So it never holds them. The request comes in two frames: a control frame the worker reads (the op and the
limits only) and a body frame (code, stdin, files) that only the child reads from the pipe, with raw
os.read, and that dies with it. The child's stdout and stderr go from its pipes into two buffers that no fork
maps (`os.readv`, no intermediate bytes objects), from there to the host's pipe (`os.write` of a memoryview)
and are then overwritten with zeros. Its processes are killed; its IPC objects and files were its namespaces'
and go with them, and the counters it could advance (pids, inode numbers, IPC ids) start afresh for the next.
Nothing of an execution is left in memory, on disk or in the kernel that a later one could read.

A worker whose child did not take the whole body exits after its reply: the stream would be out of step.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import math
import mmap
import os
import resource
import select
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator
from typing import Any, NoReturn

from factory.envs import sandbox_confine as confine
from factory.envs.sandbox_frames import _HEADER, _recv, _recv_body, _send, _write_all, _writev_all

# prctl(2) options (linux/prctl.h); ctypes because the stdlib has no prctl.
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38

_KILL_WAIT_S = 2.0  # a SIGKILLed process not gone after this is "a child it could not kill": recycle
_DRAIN_S = 1.0  # after the code's process exits, how long its pipes may stay open (held by leftovers)


# Compiled once by the fork server before it forks anything: typical code for the compiler to warm up on.
_WARM_UP = '''
import sys
def f(n: int, *args, k=None, **kw) -> str:
    if n % 15 == 0 and not args or k is not None:
        raise ValueError(f"bad {n!r:>4}")
    for i, x in enumerate([y * 2.5 for y in range(n) if y]):
        while x > 1:
            x -= 1
    try:
        with open("x") as fh:
            return str({a: b for a, b in zip(fh, "ab")} | kw)
    except (OSError, KeyError) as e:
        return str(lambda z: sum(x for x in (1, 2)))
class T:
    x: int = 1
assert f(3) == "3", "message"
print(f(15), sys.stdin.read(), [*sys.argv, T.x], end="")
'''


class _Worker:
    """The fork server. cfg: scratch (where run dirs go without fresh namespaces), wipe (dirs emptied after each run),
    drop_uid (uid the code runs as, when the worker is root), pidns (bwrap's: alone in pid and network namespaces),
    preload, deny_userns, fresh (each execution in namespaces of its own, `sandbox_confine`), ref_proc (where to
    mount the /proc they need, when bwrap's is covered), tmp_mb (size of each execution's /tmp and /dev/shm)."""

    def __init__(self, cfg: dict[str, Any], why_not_fresh: str | None):
        """why_not_fresh: None when `_start` made this process the fork server of namespaces of its own."""
        self.scratch: str = cfg["scratch"]
        self.wipe: list[str] = cfg["wipe"]
        self.pidns: bool = cfg["pidns"]
        self.tmp_bytes = int(cfg.get("tmp_mb", 64)) << 20
        self.runs = 0
        self.libc = ctypes.CDLL(None, use_errno=True)
        # The code's process installs this filter: no keyrings; no user namespaces unless allowed.
        prog = confine.seccomp_program(os.uname().machine, cfg.get("deny_userns", True))
        if prog is None and cfg.get("deny_userns", True):
            raise SystemExit(f"cannot deny user namespaces on {os.uname().machine}: no seccomp filter for it "
                             f"(allow_userns=True runs without one)")
        self.seccomp = confine.Seccomp(prog) if prog is not None else None
        self.base_mnt = None
        if why_not_fresh is None:
            try:
                self.base_mnt = confine.start_fork_server([cfg["ref_proc"]] if cfg.get("ref_proc") else [])
            except OSError as e:
                why_not_fresh = str(e)
        # As the fork server of namespaces of its own the worker already is the code's uid (`_start`).
        self.uid: int | None = None if self.base_mnt is not None else cfg.get("drop_uid")
        self.pid1 = os.getpid() == 1  # init of the pid namespace its executions run in: kill(-1) spares it
        # The code's output lands here and only here (see the module docstring); grown, never shrunk.
        self.out_buf, self.err_buf = _buffer(1), _buffer(1)
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
        # The first compile() and json.loads() of a process set up state (parser tables, interned names)
        # that then costs every child ~2.5 ms of CPU and copy-on-write faults; done once here, on text of
        # our own (never a request's: see the module docstring), the child's compile of small code is ~0.2 ms.
        json.loads(json.dumps({"code": _WARM_UP, "stdin": "", "files": {"a.txt": ""}}))
        compile(_WARM_UP, "main.py", "exec", dont_inherit=True)
        # Everything alive now is never collected: a collection in a child would touch (and so copy)
        # every page of the fork server's heap.
        gc.freeze()
        if self.uid is not None:
            for d in self.wipe:
                os.chmod(d, 0o1777)  # the code's uid creates its run dir here; sticky: nobody else's files
        # Namespaces of its own for every execution, where the kernel lets us make them (one empty execution
        # through them tells); else the pool gives every execution a fresh worker.
        self.fresh = self.base_mnt is not None
        if self.fresh and (why_not_fresh := self._probe_confinement()) is not None:
            self.fresh = False
        self.why_not_fresh = why_not_fresh

    def serve(self) -> None:
        _send(1, {"op": "ready", "pid": os.getpid(), "fresh": self.fresh, "why_not_fresh": self.why_not_fresh})
        while True:
            req = _recv(0)
            if req is None:
                return  # the host closed our stdin: it is gone or retired us
            op = req.get("op")
            if op == "ping":
                _send(1, {"op": "pong", "runs": self.runs})
            elif op == "exec":
                self.execute(req["limits"])
            else:
                _send(1, {"op": "error", "error": f"unknown op {op!r}"})

    # -- one execution -----------------------------------------------------------------------------------

    def execute(self, lim: dict[str, Any]) -> None:
        """One execution: fork the child (it reads the body frame), supervise it, reply, clean up."""
        self.runs += 1
        # In namespaces of its own the run dir is in a /tmp nobody else sees: one name for all, so that not even
        # the number of executions before it shows.
        run_dir = "/tmp/run" if self.fresh else os.path.join(self.scratch, f"run-{self.runs}")
        cap = int(lim["output_bytes"])
        if len(self.out_buf) < cap + 1:  # one byte more than the cap: a full buffer means "truncated"
            self.out_buf, self.err_buf = _buffer(cap + 1), _buffer(cap + 1)
        if self.fresh:
            try:
                confine.begin_execution(self.base_mnt, self.tmp_bytes)
            except OSError as e:  # the request stays unread in the pipe: reply, then exit (out of step)
                self._reply({"exit_code": None, "signal": None, "timed_out": False, "truncated": False,
                             "memory_error": False, "wall_s": 0.0, "leftovers": {}, "dirty": [],
                             "fault": f"could not make the execution's namespaces: {e}"}, 0, 0)
                os._exit(0)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        took_r, took_w = os.pipe()  # the child writes one byte once it has read the whole body
        os.set_blocking(took_r, False)
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the code's process: never returns
            try:
                os.close(took_r)
                self._child(lim, run_dir, out_w, err_w, took_w, (out_r, err_r))
            except BaseException:  # noqa: BLE001 - report setup failures as the code's stderr
                _report_setup_failure()
            finally:
                os._exit(126)
        for fd in (out_w, err_w, took_w):
            os.close(fd)
        try:
            res, n_out, n_err, took = self._supervise(pid, out_r, err_r, took_r, cap, lim, t0)
        finally:
            os.close(took_r)
        if not took:
            res["fault"] = res["fault"] or "the execution did not read its whole request"
        self._reply(res, n_out, n_err)
        if not took:
            os._exit(0)  # the rest of the body is still in the pipe: the stream is out of step

    def _reply(self, res: dict[str, Any], n_out: int, n_err: int) -> None:
        """The result, then the code's output from the buffers, which are zeroed afterwards."""
        res["op"] = "result"
        res["stdout_bytes"], res["stderr_bytes"] = n_out, n_err
        try:
            body = json.dumps(res).encode()
            # One writev of the header and views of the buffers: no copy of the output is made.
            _writev_all(1, [_HEADER.pack(len(body)) + body, memoryview(self.out_buf)[:n_out],
                            memoryview(self.err_buf)[:n_err]])
        finally:
            # Zeros over what the code wrote (and the byte past the cap that told of truncation).
            for buf, n in ((self.out_buf, n_out), (self.err_buf, n_err)):
                k = min(n + 1, len(buf))
                buf[:k] = bytes(k)

    def _supervise(self, pid: int, out_r: int, err_r: int, took_r: int, cap: int, lim: dict[str, Any],
                   t0: float) -> tuple[dict[str, Any], int, int, bool]:
        """Watch the execution until it exits (and its pipes close) or a limit; kill, reap and wipe after it, and
        look for what it left. Returns the reply (without the output), the bytes of stdout and stderr in the
        buffers, and whether the child took its whole request."""
        bufs = {out_r: memoryview(self.out_buf), err_r: memoryview(self.err_buf)}
        filled = {out_r: 0, err_r: 0}
        open_fds = {out_r, err_r}
        pidfd = os.pidfd_open(pid)
        poller = select.poll()
        for fd in (out_r, err_r, pidfd):
            poller.register(fd, select.POLLIN)
        # fd 0 for POLLHUP only (the host is gone): it stays readable until the child has read the body.
        poller.register(0, 0)
        end = t0 + float(lim["wall_s"])
        drain_end = None
        exited = timed_out = truncated = swept = False
        wall = None
        running = 0  # the code's other processes still there when it exited
        try:
            while open_fds or not exited:
                now = time.monotonic()
                limit = drain_end if exited else end
                if now >= limit:
                    timed_out = not exited
                    break
                ready = {fd for fd, _ in poller.poll(math.ceil((limit - now) * 1000))}
                if 0 in ready:  # the host is gone
                    self._sweep(pid)
                    os._exit(0)
                for fd in ready & open_fds:
                    # Straight into the buffer: no bytes object holds the code's output.
                    n = os.readv(fd, [bufs[fd][filled[fd]:cap + 1]])
                    if not n:
                        open_fds.discard(fd)
                        poller.unregister(fd)
                        continue
                    filled[fd] += n
                    if filled[fd] > cap:
                        truncated, filled[fd] = True, cap
                if truncated:
                    break
                if pidfd in ready and not exited:
                    poller.unregister(pidfd)
                    exited, wall = True, time.monotonic() - t0
                    running = self._others(pid)
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
            # Read after the fact, not watched: a wakeup of ours in mid-run would cost the code its CPU.
            try:
                took = os.read(took_r, 1) == b"1"
            except BlockingIOError:
                took = False
        finally:
            for fd in (out_r, err_r, pidfd):
                os.close(fd)
        if fault is None and (self.pidns or self.pid1) and not self._namespace_empty(_KILL_WAIT_S):
            fault = "processes survived the kill"
        # What it left where only it could reach (removed with its namespaces), and where later executions on this
        # worker could (the pool then replaces the worker).
        leftovers: dict[str, int] = {}
        if self.fresh:
            try:
                leftovers = confine.end_execution(self.base_mnt)
            except OSError as e:
                fault = fault or f"could not clean up after the execution: {e}"
        if running:
            leftovers["processes"] = running
        dirty = {}
        try:
            if (files := self._wipe_all()) and self.fresh:
                dirty["files"] = files
        except Exception as e:  # noqa: BLE001 - a tree the code made unremovable: recycle the worker
            fault = fault or f"could not wipe the run's files: {type(e).__name__}: {e}"
        if self.pidns and (sockets := confine.tcp_sockets()):
            dirty["tcp_sockets"] = sockets
        exit_code = sig = None
        if status is not None:
            if os.WIFSIGNALED(status):
                sig = _signal_name(os.WTERMSIG(status))
            else:
                exit_code = os.waitstatus_to_exitcode(status)
        n_out, n_err = filled[out_r], filled[err_r]
        memory_error = exit_code not in (None, 0) and self.err_buf.find(b"MemoryError", max(0, n_err - 2048),
                                                                         n_err) >= 0
        return ({"exit_code": exit_code, "signal": sig, "timed_out": timed_out, "truncated": truncated,
                 "memory_error": memory_error, "wall_s": wall, "fault": fault, "leftovers": {**leftovers, **dirty},
                 "dirty": sorted(dirty)}, n_out, n_err, took)

    def _child(self, lim: dict[str, Any], run_dir: str, out_w: int, err_w: int, took_w: int,
               inherited: tuple[int, ...]) -> NoReturn:
        """The code's process: its own session, its output pipes, the code's uid (as root, without namespaces of its
        own), limits it cannot lift; then it reads its request and runs it."""
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
        body = _recv_body(0)  # read here, in the code's own process: no other ever holds the request
        if body is None:
            os._exit(126)
        os.write(took_w, b"1")
        os.close(took_w)
        self._run_code(*body, lim, run_dir)

    def _run_code(self, code: str, stdin: bytes, files: dict[str, str], lim: dict[str, Any], run_dir: str) -> NoReturn:
        """The code's process: no capabilities, the seccomp filter, a fresh run dir with its files, stdin, rlimits;
        then the code, as `__main__`."""
        if self.fresh:
            confine.drop_capabilities()  # it owns its user namespace: it had them all there
        if self.seccomp is not None:
            self.seccomp.install()
        os.mkdir(run_dir, 0o700)
        for name, text in files.items():
            path = os.path.join(run_dir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write_file(path, text)
        if "main.py" not in files:
            _write_file(os.path.join(run_dir, "main.py"), code)  # for tracebacks' source lines
        os.chdir(run_dir)
        stdin_fd = os.memfd_create("stdin")  # no pipe to deadlock on, no file for the code to find
        _write_all(stdin_fd, stdin)
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
        _run_as_main(code, run_dir, self.stdio)

    def _probe_confinement(self) -> str | None:
        """Why executions cannot have namespaces of their own here (None: they can): one empty execution."""
        try:
            confine.begin_execution(self.base_mnt, self.tmp_bytes)
            pid = os.fork()
            if pid == 0:
                try:
                    confine.drop_capabilities()
                finally:
                    os._exit(0)
            status = os.waitpid(pid, 0)[1]
            confine.end_execution(self.base_mnt)
        except OSError as e:
            return str(e)
        return None if status == 0 else f"an empty execution ended with status {status}"

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
            if self.pidns or self.pid1:
                # kill(-1) reaches every process of ours in the namespace but ourselves and pid 1 (bwrap's
                # init, or we are it): also the ones that left the group with setsid.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(-1, signal.SIGKILL)
        if not (self.pidns or self.pid1) and self.uid is not None:
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

    def _others(self, pid: int) -> int:
        """Processes of the execution other than its first (pid) in our pid namespace: as its init, only ours."""
        if not self.pid1:
            return 0
        return sum(1 for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, pid))

    def _namespace_empty(self, timeout: float) -> bool:
        me, end = os.getpid(), time.monotonic() + timeout
        while True:
            if self.pid1:  # as init, the processes the code orphaned are ours to reap
                with contextlib.suppress(ChildProcessError):
                    while os.waitpid(-1, os.WNOHANG)[0]:
                        pass
            if not [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]:
                return True
            if time.monotonic() >= end:
                return False
            time.sleep(0.001)  # killed processes are being torn down (and reaped by pid 1); no event for it

    def _wipe_all(self) -> int:
        """Empty the wipe dirs; how many entries were in them."""
        n = 0
        with self._as_code_uid():
            for root in self.wipe:
                for name in os.listdir(root):
                    _remove_tree(os.path.join(root, name))
                    n += 1
        return n


def _buffer(n: int) -> mmap.mmap:
    """n zero bytes that no fork of ours copies: no child ever maps any output, and each fork is cheaper."""
    buf = mmap.mmap(-1, n)
    buf.madvise(mmap.MADV_DONTFORK)
    return buf


def _report_setup_failure(prefix: str = "sandbox setup failed: ") -> None:
    """The current exception's traceback on stderr (the code's, once the child has its pipes)."""
    with contextlib.suppress(Exception):
        os.write(2, (prefix + traceback.format_exc()).encode())


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


def _run_as_main(code: str, run_dir: str, stdio: tuple) -> None:
    """Run code like `python main.py` would, in this (forked) process, and exit with its status."""
    sys.stdin, sys.stdout, sys.stderr = stdio
    main = types.ModuleType("__main__")
    main.__file__ = os.path.join(run_dir, "main.py")
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    sys.path[0] = run_dir
    status = 0
    try:
        # dont_inherit: not this module's `from __future__ import annotations`
        exec(compile(code, "main.py", "exec", dont_inherit=True), main.__dict__)  # noqa: S102 - the point of the sandbox
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:  # noqa: BLE001 - an uncaught exception: traceback and status 1, like python
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this function's frame
        status = 1
    try:
        threading._shutdown()  # wait for non-daemon threads, as interpreter exit does
        atexit._run_exitfuncs()  # prints and ignores what a function raises, SystemExit too, as python does
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _exit_status(e: SystemExit) -> int:
    """The status `python` exits with for this SystemExit (Python/pythonrun.c, _Py_HandleSystemExit): None is 0;
    an int is converted to a C long long (out of range: -1) and passed to exit(), which keeps its low 8 bits;
    anything else is printed to stderr and gives 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF if -(1 << 63) <= e.code < (1 << 63) else 255
    with contextlib.suppress(Exception):
        print(e.code, file=sys.stderr)
    return 1


def _start(cfg: dict[str, Any]) -> str | None:
    """Make this process the fork server of namespaces of its own (sandbox_confine): returns None in it, or, where
    the kernel refuses, why not (in this process, which then serves as before). As root, first the reference
    /proc and the code's uid: this process forks one that owns the new user and pid namespaces, whose child is
    the fork server (pid 1 there); the two before it only wait, and end with it."""
    why = confine.mount_reference_proc(cfg["ref_proc"]) if cfg.get("ref_proc") else None
    if not cfg.get("fresh") or why is not None:
        return why or "not asked for"
    libc = ctypes.CDLL(None, use_errno=True)
    r, w = os.pipe()
    owner = os.fork()
    if owner == 0:
        try:
            os.close(r)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if (uid := cfg.get("drop_uid")) is not None:
                os.setgroups([])
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)  # all capabilities go with uid 0
            libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # the uid change made us non-dumpable: our /proc is root's
            confine.enter_user_and_pid_namespaces()
            libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
            if os.fork() == 0:
                os.close(w)
                libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # ends with the namespaces' owner
                return None  # the fork server
            os.write(w, b"ok")
        except BaseException as e:  # noqa: BLE001 - the outer process serves instead
            with contextlib.suppress(OSError):
                os.write(w, f"{type(e).__name__}: {e}".encode()[:500])
            os._exit(0)
        _wait_and_exit(w)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read()
    if said != b"ok":
        os.waitpid(owner, 0)
        return said.decode("utf-8", "replace") or "the namespaces' owner died"
    _wait_and_exit(-1)


def _wait_and_exit(fd: int) -> NoReturn:
    """Leave the host's pipes to the fork server, wait for our child and exit as it did."""
    for f in (0, 1, fd):
        with contextlib.suppress(OSError):
            os.close(f)
    status = os.wait()[1]
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _worker_main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C on the host's terminal is the host's business
    cfg = json.loads(argv[0])
    _Worker(cfg, _start(cfg)).serve()


if __name__ == "__main__":  # the pool runs this file's text with `python -c`, the config in argv[1]
    _worker_main(sys.argv[1:])
