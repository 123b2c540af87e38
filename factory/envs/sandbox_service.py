"""The sandbox pool as a service: an HTTP API on 127.0.0.1 over one `SandboxPool`, and its client.

`factory sandbox-serve` starts it in its own process, so generated code never runs in the trainer's
process and a pool can live on another machine (or pod) than its callers. `RemoteSandboxPool(url).run()`
has `SandboxPool.run()`'s signature and returns the same `ExecResult`.

Endpoints:
- `GET /health` - 200 when the pool is started.
- `GET /metrics` - the pool's `metrics()` plus "pid".
- `POST /run` - {"code", "stdin"?, "files"?, "limits"?} -> ExecResult as JSON. `limits` holds any of
  `SandboxLimits`' fields; the rest are the server's defaults. Many requests run side by side, as many
  at a time as the pool has workers; the rest wait for one. 422 for a malformed request or bad file
  names; anything the code does is a 200 with ok=false and a reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from factory.envs.sandbox import ExecResult, SandboxLimits, SandboxPool


class LimitsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cpu_s: float | None = Field(None, gt=0)
    wall_s: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    processes: int | None = Field(None, gt=0)
    file_size_mb: int | None = Field(None, gt=0)
    open_files: int | None = Field(None, gt=0)
    output_bytes: int | None = Field(None, gt=0)


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str
    stdin: str = ""
    files: dict[str, str] | None = None
    limits: LimitsIn | None = None


def create_app(pool: SandboxPool) -> FastAPI:
    """An app over a started pool (the caller owns it and closes it)."""
    app = FastAPI(title="Factory sandbox pool")
    # One thread per worker: a request beyond that would only wait in acquire() holding a thread.
    executor = ThreadPoolExecutor(max_workers=pool.size, thread_name_prefix="sandbox-run")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> dict:
        return {**pool.metrics(), "pid": os.getpid()}

    @app.post("/run")
    async def run(body: RunRequest) -> dict:
        limits = None
        if body.limits is not None:
            limits = dataclasses.replace(pool.limits, **body.limits.model_dump(exclude_none=True))
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(executor, lambda: pool.run(body.code, body.stdin, body.files, limits))
        except ValueError as e:  # bad file names: the caller's mistake
            raise HTTPException(status_code=422, detail=str(e)) from e
        return result.to_dict()

    return app


def serve(host: str = "127.0.0.1", port: int = 8200, size: int = 4, isolation: str = "bwrap",
          log_level: str = "warning") -> None:
    """Serve a sandbox pool in the foreground until interrupted (the `factory sandbox-serve` command).
    Raises IsolationUnavailable before binding when bwrap cannot run here."""
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the SIGTERM it caught once it has shut down; exit through Python then, so the
        # pool below is closed (its cgroups and scratch dirs removed) instead of the process just dying.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    with SandboxPool(size=size, isolation=isolation) as pool:
        uvicorn.run(create_app(pool), host=host, port=port, log_level=log_level, lifespan="off")


class RemoteSandboxPool:
    """A client of `factory sandbox-serve` with `SandboxPool.run()`'s signature."""

    def __init__(self, url: str, timeout: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout = timeout  # on top of the run's own wall limit
        self._client = httpx.Client(timeout=timeout)

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None,
            limits: SandboxLimits | None = None) -> ExecResult:
        """Run code remotely. ValueError for a request the server rejects (422); httpx errors when the
        service is unreachable."""
        body: dict[str, Any] = {"code": code, "stdin": stdin, "files": files}
        wall = SandboxLimits().wall_s
        if limits is not None:
            body["limits"] = dataclasses.asdict(limits)
            wall = limits.wall_s
        r = self._client.post(f"{self.url}/run", json=body, timeout=self.timeout + wall)
        if r.status_code == 422:
            raise ValueError(f"sandbox service rejected the request: {r.json().get('detail')}")
        r.raise_for_status()
        return ExecResult.from_dict(r.json())

    def metrics(self) -> dict[str, Any]:
        r = self._client.get(f"{self.url}/metrics")
        r.raise_for_status()
        return r.json()

    def health(self) -> bool:
        try:
            return self._client.get(f"{self.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteSandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
