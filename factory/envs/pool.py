"""The sandbox pool of this process, which code verifiers and tools run generated code in (`envs/sandbox.py`), or
the remote pool service `factory sandbox-serve` (`envs/sandbox_service.py`): started on first use, with the
spec's settings (`configure_sandbox`) or the environment's."""

from __future__ import annotations

import os
import threading
from typing import Any

from factory.envs.sandbox import SandboxPool

_POOL_LOCK = threading.Lock()
_POOL = None
_CONFIG: dict[str, Any] = {}


def configure_sandbox(size: int, isolation: str, cpus: list[int] | None = None) -> None:
    """The pool this process's rewards and tools use (a spec's `task.sandbox_workers` / `sandbox_isolation`);
    a running pool with other settings is closed and replaced on next use."""
    global _POOL
    with _POOL_LOCK:
        new = {"size": int(size), "isolation": isolation, "cpus": sorted(cpus) if cpus else None}
        if new != _CONFIG and _POOL is not None:
            _POOL.close()
            _POOL = None
        _CONFIG.clear()
        _CONFIG.update(new)


def _env_cpus(name: str) -> list[int] | None:
    value = os.environ.get(name, "").strip()
    try:
        return [int(c) for c in value.split(",")] if value else None
    except ValueError:
        raise ValueError(f"${name}: expected comma-separated CPU numbers, got {value!r}") from None


def sandbox_pool():
    """The sandbox pool that code rewards and tools run in: the pool service at $FACTORY_SANDBOX_URL (`factory
    sandbox-serve`, e.g. on another machine) if set, else this process's own, started on first use with the
    settings of `configure_sandbox` (from the spec), else $FACTORY_SANDBOX_SIZE (default 4) and
    $FACTORY_SANDBOX_ISOLATION (default bwrap; `none` only when explicitly set), on the cores of
    `task.sandbox_cpus` or $FACTORY_SANDBOX_CPUS ("0,1"; default: the caller's)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            if url := os.environ.get("FACTORY_SANDBOX_URL"):
                from factory.envs.sandbox_service import RemoteSandboxPool  # noqa: PLC0415 - heavy: fastapi, uvicorn

                _POOL = RemoteSandboxPool(url)
            else:
                _POOL = SandboxPool(
                    size=_CONFIG.get("size") or int(os.environ.get("FACTORY_SANDBOX_SIZE", "4")),
                    isolation=_CONFIG.get("isolation") or os.environ.get("FACTORY_SANDBOX_ISOLATION", "bwrap"),
                    cpus=_CONFIG.get("cpus") or _env_cpus("FACTORY_SANDBOX_CPUS"),
                ).start()
        return _POOL
