"""The sandbox pool as a service: an HTTP API on 127.0.0.1 over one `SandboxPool`, and its client.

`factory sandbox-serve` starts it in its own process, so generated code never runs in the trainer's
process and a pool can live on another machine (or pod) than its callers. `RemoteSandboxPool(url).run()`
has `SandboxPool.run()`'s signature and returns the same `ExecResult`.

Endpoints:
- `GET /health` - 200 when the pool is started.
- `GET /metrics` - the pool's `metrics()` plus "pid".
- `POST /run` - {"code", "stdin"?, "files"?, "limits"?} -> ExecResult as JSON. `limits` holds any of
  `SandboxLimits`' fields (finite, within `LIMIT_MAX`); the rest are the server's defaults. Many requests
  run side by side, as many at a time as the pool has workers; the rest wait for one. Anything the code
  does is a 200 with ok=false and a reason.

Errors (`factory/infra/http_guard.py`): {"error": {"message", "type", "field"}}. 422 for a malformed request,
out-of-range limits, bad file names or text that is not Unicode, naming the field; 413 for a body over
`max_body_bytes`; 503 when no worker is free within 30 s or the pool is closing; 500 (short) for a bug here.
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
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from factory.envs.sandbox import LIMIT_MAX, ExecResult, SandboxLimits, SandboxPool, SandboxRequestError
from factory.infra import http_client
from factory.infra.http_guard import MAX_JSON_BYTES, RequestError, guard


class LimitsIn(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    cpu_s: float | None = Field(None, gt=0, le=LIMIT_MAX["cpu_s"])
    wall_s: float | None = Field(None, gt=0, le=LIMIT_MAX["wall_s"])
    memory_mb: int | None = Field(None, gt=0, le=LIMIT_MAX["memory_mb"])
    processes: int | None = Field(None, gt=0, le=LIMIT_MAX["processes"])
    file_size_mb: int | None = Field(None, gt=0, le=LIMIT_MAX["file_size_mb"])
    open_files: int | None = Field(None, gt=0, le=LIMIT_MAX["open_files"])
    output_bytes: int | None = Field(None, gt=0, le=LIMIT_MAX["output_bytes"])


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    code: str
    stdin: str = ""
    files: dict[str, str] | None = None
    limits: LimitsIn | None = None


def create_app(pool: SandboxPool, max_body_bytes: int = MAX_JSON_BYTES) -> FastAPI:
    """An app over a started pool (the caller owns it and closes it)."""
    app = guard(FastAPI(title="Factory sandbox pool"), validation_status=422, max_body_bytes=max_body_bytes)
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
            try:
                limits = dataclasses.replace(pool.limits, **body.limits.model_dump(exclude_none=True))
            except ValueError as e:  # SandboxLimits' own checks, should the model's bounds ever differ
                raise RequestError(422, f"limits: {e}", "limits") from e
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(executor, lambda: pool.run(body.code, body.stdin, body.files, limits))
        except SandboxRequestError as e:  # bad file names, text that is not Unicode: the caller's mistake
            raise RequestError(422, str(e), e.field) from e
        except TimeoutError as e:  # every worker busy for 30 s: try again later
            raise RequestError(503, str(e), None, "unavailable") from e
        except RuntimeError as e:  # the pool is closing
            raise RequestError(503, f"sandbox pool unavailable: {e}", None, "unavailable") from e
        return result.to_dict()

    return app


def serve(host: str = "127.0.0.1", port: int = 8200, size: int = 4, isolation: str = "bwrap",
          log_level: str = "warning", max_body_bytes: int = MAX_JSON_BYTES) -> None:
    """Serve a sandbox pool in the foreground until interrupted (the `factory sandbox-serve` command).
    Raises IsolationUnavailable before binding when bwrap cannot run here."""
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the SIGTERM it caught once it has shut down; exit through Python then, so the
        # pool below is closed (its cgroups and scratch dirs removed) instead of the process just dying.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    with SandboxPool(size=size, isolation=isolation) as pool:
        uvicorn.run(create_app(pool, max_body_bytes), host=host, port=port, log_level=log_level, lifespan="off")


class RemoteSandboxPool:
    """A client of `factory sandbox-serve` with `SandboxPool.run()`'s signature."""

    def __init__(self, url: str, timeout: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout = timeout  # on top of the run's own wall limit
        self._client = http_client.client(timeout=timeout)

    def run(self, code: str, stdin: str = "", files: dict[str, str] | None = None,
            limits: SandboxLimits | None = None) -> ExecResult:
        """Run code remotely. ValueError for a request the server refuses (4xx, its message naming the field);
        httpx errors when the service is unreachable or failed (5xx)."""
        body: dict[str, Any] = {"code": code, "stdin": stdin, "files": files}
        wall = SandboxLimits().wall_s
        if limits is not None:
            body["limits"] = dataclasses.asdict(limits)
            wall = limits.wall_s
        r = self._client.post(f"{self.url}/run", json=body, timeout=self.timeout + wall)
        if 400 <= r.status_code < 500:
            raise ValueError(f"sandbox service refused the request ({r.status_code}): {_error_message(r)}")
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


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:500]
