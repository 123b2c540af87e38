"""Supervised service processes: start a child, wait until it is healthy, restart it when it dies.

The rollout server runs as its own process; when it crashes mid-generation the orchestrator calls
`ServiceProcess.recover()` (from `retry`, the retry loop every caller uses), which restarts it
on the same port and lets the caller retry. Callers keep requests idempotent (whole prompt groups
are retried, keyed by group id), so a restart neither loses nor double-counts work.

A circuit breaker stops a crash loop: a service restarted `breaker_restarts` times within
`breaker_window_s` seconds is not restarted again; `ensure_alive()` / `recover()` raise `CircuitOpen`
with the tail of its log, so the run can stop cleanly and say which service failed and why.

A watchdog catches the service that hangs instead of dying: with `hang_timeout_s` set, a thread asks its
health URL every `heartbeat_s`; a process that answers none of them for `hang_timeout_s` is killed, so the
next call fails fast and restarts it like any crash (and it counts toward the breaker).

`retry` (on tenacity) is the one retry loop of Factory: calls through a service restart, lake commits that lost
a race, node patches that conflicted; each caller says what is retried, how often, and what happens between.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import tenacity

from factory.infra import http_client
from factory.infra.spare import Spare, SpareProcess

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors that mean "the service is gone or going", as opposed to a bad request.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError, httpx.ConnectTimeout,
    ConnectionError,
)


class ServiceUnavailable(RuntimeError):
    """The service could not be (re)started healthy within its limits."""


class CircuitOpen(ServiceUnavailable):
    """The service crashed too often in too short a time; it is not restarted again."""


class DiedStarting(ServiceUnavailable):
    """The service's process exited before it answered its health check."""


@dataclass(frozen=True)
class Restart:
    at: float  # the supervisor's clock (monotonic by default) when the restart began
    exit_code: int | None  # how the previous process ended (negative: killed by that signal)


LOG_TAIL_LINES = 20


def die_with_parent() -> None:
    """In a child between fork and exec: ask Linux to SIGKILL it when the thread that started it ends
    (prctl PR_SET_PDEATHSIG). Elsewhere a no-op. The supervisor starts and restarts services from long-lived
    threads (the trainer's main thread, producer threads), which end only when the run ends or dies."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """Whether another socket holds `port` now (a closing connection's TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


PORT_TRIES = 3  # ports tried at a first start whose port this class picked


class ServiceProcess:
    """A child process serving HTTP on 127.0.0.1:`port`, with a health URL and bounded restarts.

    `argv` may contain `{port}`, replaced by the port (kept across restarts so clients need no
    new address). Output goes to `log_path` (appended; one file across restarts). A port picked here (no `port`
    given) was free when picked, not when the child binds it: a first start that dies while another socket holds
    that port is tried again on a new one (PORT_TRIES ports in all).

    Restarts are bounded twice: `max_restarts` over the service's life, and the circuit breaker: the
    `breaker_restarts`+1-th restart needed within `breaker_window_s` seconds raises `CircuitOpen` instead,
    and so does every later attempt (the breaker stays open). `clock` measures the window.
    """

    def __init__(self, name: str, argv: Sequence[str], port: int | None = None, health_path: str = "/health",
                 env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 startup_timeout: float = 60.0, max_restarts: int = 5, cwd: str | Path | None = None,
                 breaker_restarts: int = 3, breaker_window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, hang_timeout_s: float | None = None,
                 heartbeat_s: float = 2.0, cpus: Iterable[int] | None = None, spare: Spare | None = None):
        if breaker_restarts < 1 or not breaker_window_s > 0:
            raise ValueError(f"{name}: breaker_restarts must be >= 1 and breaker_window_s > 0, got "
                             f"{breaker_restarts} and {breaker_window_s}")
        self.name = name
        self._argv, self._health_path, self._picked_port = list(argv), health_path, not port
        self._use_port(port or free_port())
        self.env = env
        self.cwd = cwd
        self.cpus = frozenset(cpus) if cpus else None  # placement: the child's cores (set before it runs)
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.max_restarts = max_restarts
        self.restarts = 0
        self.breaker_restarts, self.breaker_window_s, self._clock = breaker_restarts, breaker_window_s, clock
        self._history: list[Restart] = []
        self._open: str | None = None  # the CircuitOpen message once the breaker tripped
        self._proc: subprocess.Popen | SpareProcess | None = None
        self._spare = spare  # a warm process (infra/spare.py) for the first start; restarts start cold
        self._lock = threading.Lock()
        self.hang_timeout_s, self.heartbeat_s = hang_timeout_s, heartbeat_s
        self.hangs = 0  # processes the watchdog killed for not answering
        self._last_ok = time.monotonic()
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None

    def _use_port(self, port: int) -> None:
        self.port = port
        self.argv = [a.replace("{port}", str(port)) for a in self._argv]
        self.url = f"http://127.0.0.1:{port}"
        self.health_url = self.url + self._health_path

    @property
    def restart_history(self) -> tuple[Restart, ...]:
        """Every restart so far, oldest first (`restarts` is their count)."""
        return tuple(self._history)

    @property
    def breaker_open(self) -> bool:
        return self._open is not None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last `lines` lines of the service's output (its log file), or why there are none."""
        if self.log_path is None:
            return "(output not kept: no log_path)"
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))  # the tail of a log can be huge
                text = f.read().decode("utf-8", errors="replace")
        except OSError as e:
            return f"(cannot read {self.log_path}: {e})"
        return "\n".join(text.splitlines()[-lines:]) or f"({self.log_path} is empty)"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> ServiceProcess:
        """Start the service and wait until it is healthy. A process killed by a signal before it was healthy (a
        kill from outside, not its own failure) is started again within the restart budget, as a later death
        would be; one that exits with an error code fails the start at once."""
        with self._lock:
            if self.alive():  # started already (a `with` around a started service): one process, not two
                return self
            while True:
                try:
                    self._first_spawn()
                    break
                except DiedStarting:
                    code = self._proc.returncode
                    if code >= 0:
                        raise
                    self._count_restart(code)
        if self.hang_timeout_s is not None and self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name=f"{self.name}-watchdog", daemon=True)
            self._watchdog.start()
        return self

    def _watch(self) -> None:
        """Kill the process when it stops answering its health check for `hang_timeout_s` (a hang)."""
        with http_client.client(timeout=self.heartbeat_s) as client:
            while not self._closed.wait(self.heartbeat_s):
                if self._lock.locked() or not self.alive():
                    self._last_ok = time.monotonic()  # starting or dead: the restart path owns it
                    continue
                try:
                    if client.get(self.health_url).status_code == 200:
                        self._last_ok = time.monotonic()
                        continue
                except httpx.HTTPError:
                    pass
                silent = time.monotonic() - self._last_ok
                if silent > self.hang_timeout_s and self.alive():
                    log.error("%s (pid %s) has not answered %s for %.0f s (hang_timeout_s=%g): killing it as hung",
                              self.name, self.pid, self.health_url, silent, self.hang_timeout_s)
                    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                        self.kill()
                    self.hangs += 1  # after the kill: a reader who sees the count sees the process gone
                    self._last_ok = time.monotonic()

    def _preexec(self) -> None:
        die_with_parent()
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)

    def _spawn(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None and self._spawn_warm(spare):
            self._wait_healthy()
            return
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - child owns it
        env = {**os.environ, **(self.env or {})}
        # A new session: a kill of the child's group never reaches us, and ours never reaches it twice. And the
        # child dies with us: a trainer killed with -9 leaves no orphaned server holding its port and memory.
        self._proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                      start_new_session=True, preexec_fn=self._preexec)
        if out is not subprocess.DEVNULL:
            out.close()
        self._wait_healthy()

    def _spawn_warm(self, spare: Spare) -> bool:
        """Start the service in the warm spare: the same command, session, cores, environment and output as a cold
        start; False (a cold start follows) when the spare cannot run it."""
        try:
            self._proc = spare.run(self.argv, env=self.env, cwd=self.cwd, log_path=self.log_path, cpus=self.cpus,
                                   title=self.name)
        except (ValueError, ChildProcessError) as e:
            log.warning("%s: starting cold: %s", self.name, e)
            spare.close()
            return False
        return True

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last_error = "no answer yet"
        with http_client.client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise DiedStarting(
                        f"{self.name}: process exited with code {self._proc.returncode} before it was healthy "
                        f"(command: {' '.join(self.argv)}; log: {self.log_path or 'not kept'}); last lines:\n"
                        f"{self.log_tail()}")
                try:
                    if client.get(self.health_url).status_code == 200:
                        log.info("%s healthy on %s (pid %s)", self.name, self.url, self._proc.pid)
                        return
                    last_error = "health check did not return 200"
                except httpx.HTTPError as e:
                    last_error = f"{type(e).__name__}: {e}"
                time.sleep(0.05)  # polling a child's readiness; bounded by the deadline
        self._terminate()
        raise ServiceUnavailable(f"{self.name}: not healthy at {self.health_url} after {self.startup_timeout:.0f}s "
                                 f"({last_error})")

    def ensure_alive(self) -> bool:
        """Restart the service if its process has died; True if a restart happened. `CircuitOpen` when it
        has crashed too often lately (and ever after); `ServiceUnavailable` past `max_restarts`."""
        with self._lock:
            if self._open is not None:
                raise CircuitOpen(self._open)
            if self.alive():
                return False
            self._count_restart(self._proc.returncode if self._proc else None)
            self._spawn()
            self._last_ok = time.monotonic()
            return True

    def _first_spawn(self) -> None:
        """`_spawn`, on a new port when a port picked here was taken before the child bound it (PORT_TRIES)."""
        for tries_left in reversed(range(PORT_TRIES if self._picked_port else 1)):
            try:
                self._spawn()
                return
            except ServiceUnavailable:
                if not tries_left or not port_taken(self.port):
                    raise
            log.warning("%s: port %d was taken before it bound it; starting it on another", self.name, self.port)
            self._use_port(free_port())

    def _count_restart(self, code: int | None) -> None:
        """Record a restart about to happen after the process died with `code`; `CircuitOpen` when it has crashed
        too often lately, `ServiceUnavailable` past `max_restarts` (the restart must not happen then)."""
        now = self._clock()
        recent = [r for r in self._history if now - r.at <= self.breaker_window_s]
        if len(recent) >= self.breaker_restarts:
            self._open = (f"{self.name}: circuit open: it died again (exit {code}) after {len(recent)} "
                          f"restarts within {self.breaker_window_s:g}s (ops.breaker_restarts="
                          f"{self.breaker_restarts}, ops.breaker_window_s={self.breaker_window_s:g}); not "
                          f"restarting it. Last lines of {self.log_path or 'its output'}:\n{self.log_tail()}")
            log.error("%s", self._open)
            raise CircuitOpen(self._open)
        if self.restarts >= self.max_restarts:
            raise ServiceUnavailable(f"{self.name}: died (exit {code}) and already restarted "
                                     f"{self.restarts} times (max_restarts={self.max_restarts}); last lines "
                                     f"of {self.log_path or 'its output'}:\n{self.log_tail()}")
        self._history.append(Restart(now, code))
        self.restarts += 1
        log.warning("%s died (exit %s); restart %d/%d", self.name, code, self.restarts, self.max_restarts)

    def recover(self) -> bool:
        """After a call failed with a connection error: restart the service if its process died; if it still
        runs, wait (bounded by the startup timeout) until it answers its health check again or dies. The
        two checks race a dying process (its socket closes before it can be reaped), so a caller that only
        asked `alive()` would retry at once into the same refusal. True if a restart happened."""
        if self.ensure_alive():
            return True
        deadline = time.monotonic() + self.startup_timeout
        with http_client.client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    return self.ensure_alive()
                try:
                    if client.get(self.health_url).status_code == 200:
                        return False
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)  # polling readiness, bounded by the deadline
        raise ServiceUnavailable(f"{self.name}: alive but not answering {self.health_url} for "
                                 f"{self.startup_timeout:.0f}s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the process (for fault-injection tests)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, sig)
            self._proc.wait(timeout=10)

    def _terminate(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
            self._proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=10)

    def stop(self) -> None:
        self._closed.set()
        with self._lock:
            self._terminate()
            if self._spare is not None:  # never started
                self._spare.close()
                self._spare = None

    def __enter__(self) -> ServiceProcess:
        return self.start() if not self.alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def retry(call: Callable[[], T], *, attempts: int | None,
          on: type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool],
          between: Callable[[int, BaseException], object] | None = None,
          wait: tenacity.wait.wait_base | None = None, sleep: Callable[[float], object] = time.sleep,
          give_up: Callable[[BaseException], BaseException] | None = None) -> T:
    """Run `call` until it returns, at most `attempts` times (None: no limit); the one retry loop of Factory.

    A failure retried is an exception that is an instance of `on` (types) or for which `on(e)` is true; any
    other exception propagates at once. After failed attempt n (1-based) and before the next: `between(n, e)`
    (restart a service, log), then a pause of `wait` seconds (a tenacity wait strategy; none by default, and
    a pause of 0 sleeps not at all) through `sleep` (e.g. an Event's `wait`, so a close cuts it short).
    After the last attempt its exception propagates unchanged, or `give_up(e)` is raised from it.
    `call` must be safe to repeat (a whole request whose result is only used when it completes).
    """
    def pause(seconds: float) -> None:
        if seconds > 0:
            sleep(seconds)

    def last(state: tenacity.RetryCallState) -> None:
        e = state.outcome.exception()
        raise give_up(e) from e

    retrying = tenacity.Retrying(
        stop=tenacity.stop_never if attempts is None else tenacity.stop_after_attempt(attempts),
        retry=(tenacity.retry_if_exception_type(on) if isinstance(on, type | tuple)
               else tenacity.retry_if_exception(on)),
        wait=wait or tenacity.wait_none(), sleep=pause, reraise=True,
        before_sleep=(lambda state: between(state.attempt_number, state.outcome.exception())) if between else None,
        retry_error_callback=last if give_up else None)
    return retrying(call)
