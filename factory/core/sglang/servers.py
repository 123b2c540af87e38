"""SGLang server processes: launch N of them from `SGLangSpec`, wait for /health, restart, stop.

Owns the command line and the process lifecycle, nothing about requests. Each server is one
`infra.supervisor.ServiceProcess` (own session/process group, log file appended across restarts,
bounded restarts with the circuit breaker, killed with the trainer):

    <python> -m sglang.launch_server --model-path M --host 127.0.0.1 --port base_port+i
        --tp-size T --base-gpu-id i*T --dtype bfloat16 [--mem-fraction-static F] <extra_args>

`--dtype bfloat16` unless `extra_args` sets a dtype: SGLang's `auto` reads `torch_dtype` from the
checkpoint's config.json and serves fp32 checkpoints as float16. `served_dtype` says which dtype the
servers run in, so weight updates are published in it (`sglang_weights.py`).

`python` is `spec.python` (sglang's own venv: it replaces the CPU torch, so it never lives in
Factory's venv) or this interpreter. With a placement (`gpus`: the GPU ids lent to rollout), each
server gets `CUDA_VISIBLE_DEVICES` = its T GPUs and `--base-gpu-id 0`. The GPU ids are indices into
this process's own visible devices (as torch numbers them), so they are mapped through the parent's
`CUDA_VISIBLE_DEVICES` when it is set (its entries, ids or UUIDs, are passed on as written). With
`spec.urls`, nothing is started: the servers there are only waited on (/health, bounded by startup_timeout_s).

Errors name the server (index, url), its log file and the log's last lines: a server that exits
during startup, one not healthy within startup_timeout_s, one that keeps dying.

Not run against a real `sglang.launch_server` (docs/hardware.md). The tests
start `tests/core/fake_sglang_server.py` through the same code path (a `python` wrapper that runs
it instead of `-m sglang.launch_server`), so the command line, /health polling, logs, restarts and
stop are exercised, but not SGLang's own startup (minutes; its /health answers 503 while it warms
up, which the poll treats as "not yet"), nor CUDA_VISIBLE_DEVICES on real GPUs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from factory.config import SGLangSpec
from factory.infra import http_client
from factory.infra.supervisor import ServiceProcess, ServiceUnavailable

LAUNCH_MODULE = "sglang.launch_server"
SERVED_DTYPE = "bfloat16"  # what Factory asks SGLang to serve in, unless extra_args says otherwise
# SGLang's --dtype choices -> the torch dtype name they serve in ("auto": the checkpoint's torch_dtype)
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
           "float": "float32", "auto": None}


class SGLangServerError(RuntimeError):
    """An SGLang server could not be started, kept alive or reached; the message names it and its log."""


def _user_dtype(extra_args: Sequence[str]) -> str | None:
    """The value of `--dtype X` / `--dtype=X` in `extra_args`, if the user set one."""
    for k, arg in enumerate(extra_args):
        if arg == "--dtype" and k + 1 < len(extra_args):
            return extra_args[k + 1]
        if arg.startswith("--dtype="):
            return arg.split("=", 1)[1]
    return None


def served_dtype(spec: SGLangSpec) -> str | None:
    """The torch dtype name ("bfloat16", ...) the servers of `spec` serve in; None when it is the checkpoint's
    own (`--dtype auto` in extra_args): weights are then published as they are."""
    chosen = _user_dtype(spec.extra_args)
    if chosen is None:
        return SERVED_DTYPE
    if chosen not in _DTYPES:
        raise SGLangServerError(f"rollout.sglang.extra_args: --dtype {chosen!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[chosen]


def launch_command(spec: SGLangSpec, model_path: str | Path, index: int, *, python: str | None = None,
                   module: str = LAUNCH_MODULE, placed: bool = False) -> list[str]:
    """The argv of server `index` (`placed`: CUDA_VISIBLE_DEVICES already narrows it to its GPUs)."""
    argv = [python or spec.python or sys.executable, "-m", module, "--model-path", str(model_path),
            "--host", "127.0.0.1", "--port", str(spec.base_port + index), "--tp-size", str(spec.tp_size),
            "--base-gpu-id", str(0 if placed else index * spec.tp_size)]
    if _user_dtype(spec.extra_args) is None:
        argv += ["--dtype", SERVED_DTYPE]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", repr(spec.mem_fraction_static)]
    return argv + list(spec.extra_args)


def visible_devices(gpus: Sequence[int], parent: str | None = None) -> list[str]:
    """`CUDA_VISIBLE_DEVICES` entries for `gpus`, indices into this process's visible devices: mapped through
    `parent` (default: this process's CUDA_VISIBLE_DEVICES) when it is set; ids and UUIDs kept as written."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    if parent is None or not parent.strip():
        return [str(g) for g in gpus]
    entries = [e.strip() for e in parent.split(",") if e.strip()]
    outside = [g for g in gpus if not 0 <= g < len(entries)]
    if outside:
        raise SGLangServerError(f"rollout.devices {list(gpus)}: {outside} not among this process's "
                                f"{len(entries)} visible GPUs (CUDA_VISIBLE_DEVICES={parent!r}); the ids index "
                                "that list")
    return [entries[g] for g in gpus]


def _wait_healthy(url: str, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with http_client.client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                r = client.get(url + "/health")
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(0.1)  # polling readiness, bounded by the deadline
    raise SGLangServerError(f"{what}: not healthy at {url}/health after {timeout:g} s "
                            f"(rollout.sglang.startup_timeout_s; last: {last})")


class _SGLangProcess(ServiceProcess):
    """A `ServiceProcess` whose first start can skip the health wait, so that N servers start side by
    side: the processes are spawned from the caller's (long-lived) thread, since the supervisor ties
    each child's life to the thread that spawned it, and only the /health polls run in threads."""

    defer_wait = False

    def _wait_healthy(self) -> None:
        if not self.defer_wait:
            super()._wait_healthy()

    def wait_healthy(self) -> None:
        super()._wait_healthy()


class SGLangServers:
    """The SGLang servers of one run: started (or found at `spec.urls`), supervised, stopped.

    `gpus`: GPU ids for rollout (placement); server i gets gpus[i*T:(i+1)*T]. `module`: what
    `-m` runs (tests substitute a fake). `max_restarts`/`breaker_*`: as `ServiceProcess`.
    """

    def __init__(self, spec: SGLangSpec, model_path: str | Path | None, log_dir: str | Path, *,
                 gpus: Sequence[int] | None = None, module: str = LAUNCH_MODULE, max_restarts: int = 3,
                 breaker_restarts: int = 3, breaker_window_s: float = 600.0):
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.external = bool(spec.urls)
        self.services: list[_SGLangProcess] = []
        if self.external:
            self.urls = [u.rstrip("/") for u in spec.urls]
            return
        if model_path is None:
            raise SGLangServerError("rollout.sglang: starting servers needs a model path (or give rollout.sglang.urls)")
        if gpus is not None and len(gpus) < spec.servers * spec.tp_size:
            raise SGLangServerError(f"rollout.sglang: {spec.servers} servers x tp_size {spec.tp_size} need "
                                    f"{spec.servers * spec.tp_size} GPUs, placement gives {len(gpus)}: {list(gpus)}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        mapped = visible_devices(gpus) if gpus is not None else None
        for i in range(spec.servers):
            env = None
            if mapped is not None:
                env = {"CUDA_VISIBLE_DEVICES": ",".join(mapped[i * spec.tp_size:(i + 1) * spec.tp_size])}
            argv = launch_command(spec, model_path, i, module=module, placed=gpus is not None)
            self.services.append(_SGLangProcess(
                f"sglang-{i}", argv, port=spec.base_port + i, env=env, log_path=self.log_dir / f"sglang-{i}.log",
                startup_timeout=spec.startup_timeout_s, max_restarts=max_restarts,
                breaker_restarts=breaker_restarts, breaker_window_s=breaker_window_s))
        self.urls = [s.url for s in self.services]

    def describe(self, i: int) -> str:
        """'sglang-i at URL' (with its log file when Factory started it)."""
        if self.external:
            return f"sglang server {i} at {self.urls[i]}"
        return f"sglang-{i} at {self.urls[i]} (log {self.services[i].log_path})"

    def _failure(self, i: int, e: BaseException) -> SGLangServerError:
        s = self.services[i]
        return SGLangServerError(f"{self.describe(i)}: {e}\nlast lines of {s.log_path}:\n{s.log_tail()}")

    def start(self) -> SGLangServers:
        """Start every server at once (SGLang takes minutes each) and wait until all answer /health."""
        if self.external:
            for i, url in enumerate(self.urls):
                _wait_healthy(url, self.spec.startup_timeout_s, self.describe(i))
            return self
        for i, s in enumerate(self.services):
            s.defer_wait = True
            try:
                s.start()
            except OSError as e:  # the python itself cannot be run
                self.stop()
                raise SGLangServerError(f"{self.describe(i)}: cannot run {s.argv[0]!r} (rollout.sglang.python: "
                                        f"the Python of sglang's own venv): {e}") from e
            finally:
                s.defer_wait = False
        errors: dict[int, BaseException] = {}

        def start_one(i: int) -> None:
            try:
                self.services[i].wait_healthy()
            except BaseException as e:  # noqa: BLE001 - collected and raised below, naming the server
                errors[i] = e

        threads = [threading.Thread(target=start_one, args=(i,), name=f"sglang-wait-{i}", daemon=True)
                   for i in range(len(self.services))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # each start is bounded by startup_timeout_s
        if errors:
            self.stop()
            first = min(errors)
            raise self._failure(first, errors[first]) from errors[first]
        return self

    def alive(self, i: int) -> bool:
        return True if self.external else self.services[i].alive()

    def recover(self, i: int) -> bool:
        """After a failed call to server i: restart it if it died (True), or wait for its /health again.
        External servers are not Factory's to restart: an error naming the server."""
        if self.external:
            _wait_healthy(self.urls[i], self.spec.startup_timeout_s, self.describe(i))
            return False
        try:
            return self.services[i].recover()
        except ServiceUnavailable as e:
            raise self._failure(i, e) from e

    def kill(self, i: int) -> None:
        """Kill server i's process group (fault injection)."""
        self.services[i].kill()

    def restarts(self) -> list[int]:
        return [s.restarts for s in self.services]

    def stop(self) -> None:
        for s in self.services:
            s.stop()

    def __enter__(self) -> SGLangServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
