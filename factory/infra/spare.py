"""A warm spare process: forked from a process that has done its imports (and run no torch operation), it waits for
one command line, then becomes that command in-process, so a service started through it skips the interpreter's
start-up and imports (about 10 s for `factory serve` on a loaded 2-core machine).

- `Spare.fork(preload)` (in the parent) forks the spare. The spare dies with the thread that forked it
  (PR_SET_PDEATHSIG), gets back the signal handlers a fresh interpreter has, imports `preload`, then waits on a pipe.
  Closing the spare unused (`close`) ends it with exit 0.
- `Spare.run(argv, ...)` hands it a command line of the form `[sys.executable, "-m", MODULE, *args]`: the spare starts
  a new session (as `start_new_session=True` would), sets its cores, environment, working directory and output, and
  runs MODULE as `__main__` with `sys.argv` as that command would have. It returns a `SpareProcess`, which has the part
  of `subprocess.Popen`'s face that a supervisor uses (`pid`, `poll`, `wait`, `kill`, `terminate`, `send_signal`,
  `returncode`: negative for a signal). A spare runs one command once.
- `install` / `take`: a process keeps at most one spare for whichever service starts first and asks for it
  (`ServiceProcess(spare=take())`); `take` gives it away once.

Forking is safe only where the parent has run no torch operation (no OpenMP pool or CUDA context exists to be
copied): `runs/standby.py` forks a spare in each attempt it forks, before the attempt does anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


class Spare:
    """The parent's handle on one warm spare (see the module docstring)."""

    def __init__(self, pid: int, fd: int):
        self.pid, self._fd = pid, fd
        self.used = False

    @classmethod
    def fork(cls, preload: Iterable[str] = ()) -> Spare:
        """Fork a spare that imports `preload` and then waits for its command."""
        read, write = os.pipe()
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the spare: never returns
            os.close(write)
            _spare_main(read, parent, list(preload))
        os.close(read)
        return cls(pid, write)

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
            log_path: str | Path | None = None, cpus: Iterable[int] | None = None,
            title: str | None = None) -> SpareProcess:
        """Make the spare run `argv` (`[sys.executable, "-m", MODULE, *args]`); ValueError for any other form, or
        when this spare was used or closed; ChildProcessError when it has died. Its command line (/proc/PID/cmdline)
        stays its parent's, so `title` names it where process tools look (/proc/PID/comm, `ps -o comm`; 15 bytes)."""
        if self.used:
            raise ValueError("this spare has already run a command or was closed")
        if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
            raise ValueError(f"a spare runs `{sys.executable} -m MODULE ...`, not {list(argv)}")
        self.used = True
        request = {"argv": list(argv), "env": env, "cwd": str(cwd) if cwd else None,
                   "log": str(log_path) if log_path else None, "cpus": sorted(cpus) if cpus else None, "title": title}
        try:
            os.write(self._fd, json.dumps(request).encode() + b"\n")
        except BrokenPipeError:
            raise ChildProcessError(f"the warm spare (pid {self.pid}) died before it was used") from None
        finally:
            os.close(self._fd)
        return SpareProcess(self.pid, argv)

    def close(self) -> None:
        """End an unused spare (it exits 0) and reap it."""
        if self.used:
            return
        self.used = True
        os.close(self._fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


class SpareProcess:
    """A spare that runs a command: a child of this process, with `subprocess.Popen`'s face."""

    def __init__(self, pid: int, argv: Sequence[str]):
        self.pid, self.args = pid, list(argv)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, how is unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            if self.returncode is None:
                try:
                    _, status = os.waitpid(self.pid, 0)
                    self.returncode = os.waitstatus_to_exitcode(status)
                except ChildProcessError:
                    self.returncode = -signal.SIGKILL
            return self.returncode
        # A short poll bounded by `timeout`, as subprocess.Popen.wait itself does for a timed wait.
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _spare_main(fd: int, parent: int, preload: list[str]) -> None:
    """The spare's whole life: wait for a command, become it, exit with its code. Never returns."""
    code = 1
    try:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(128 + signal.SIGKILL)  # the parent died before the death signal was armed
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)
        for module in preload:
            __import__(module)
        line = b""
        with open(fd, "rb", buffering=0) as pipe:
            while not line.endswith(b"\n"):
                chunk = pipe.read(65536)
                if not chunk:
                    os._exit(0)  # closed unused
                line += chunk
        request = json.loads(line)
        code = _become(request)
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:  # as python does: it ends by the signal itself (exit -2)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - reported as the command's own failure would be
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _become(request: dict) -> int:
    os.setsid()
    if request["title"]:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, request["title"].encode()[:15])
    if request["cpus"]:
        os.sched_setaffinity(0, request["cpus"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request["log"]:
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    else:
        out = os.open(os.devnull, os.O_WRONLY)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    if request["env"]:
        os.environ.update(request["env"])
    # The standard streams a fresh interpreter has (the parent's may be wrapped, e.g. by a test runner's capture).
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115 - the process's own, for its whole life
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
    if request["cwd"]:
        os.chdir(request["cwd"])
    module = request["argv"][2]
    sys.argv = [module, *request["argv"][3:]]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return _exit_code(e.code)
    return 0


def _exit_code(code: object) -> int:
    """What `python` exits with for `SystemExit(code)` (_Py_HandleSystemExit): None is 0; an int becomes a C long
    long (out of range: -1) whose low 8 bits exit() keeps; anything else is printed to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if -(1 << 63) <= code < (1 << 63) else 255
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


_installed: Spare | None = None


def install(spare: Spare) -> None:
    """Keep `spare` for the first service of this process that asks (`take`)."""
    global _installed
    _installed = spare


def take() -> Spare | None:
    """This process's spare, once (None when there is none, or it was taken)."""
    global _installed
    spare, _installed = _installed, None
    return spare
