"""The eval server: one long-lived process that evaluates many recorded checkpoints, so a periodic eval does not
pay a process start, the torch/transformers imports and the lake's opening per partition.

The server (eval_serve.py: `factory eval-serve`, `python -m factory.runs.eval_serve`) binds 127.0.0.1 and answers
`POST /eval {"run_id", "step", "benchmark", "tolerance"}` with what `evaluate_and_draw` returns in-process: the
eval's record, the run's redrawn evals-by-step picture and the regression check (the same function, so the same
digest check, reuse of recorded rows, rows written to `evals`, picture stored on the MLflow run, and generated
code scored through the sandbox pool as every eval does); `GET /health` says who it is. Evals run one at a time;
the server exits after `idle_s` without a request.

This module is the client side (`evaluate_remote`, `live_server`, `start_server`, `stop_server`) and what both sides
share; it imports neither torch nor mlflow nor matplotlib: the `checkpoint_eval` asset's run worker imports it. A
server is found through `<FACTORY_HOME>/run/eval-server.json` (its pid and port), checked alive by `GET /health` (pid
and home must match: a reused pid or another home's server is not it), and started on demand as a detached process
under a file lock, so two evals never start two servers.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from factory.home import FactoryPaths, file_lock
from factory.runs.checkpoint_eval import CheckpointEval, DrawnEval, RegressionCheck

HOST = "127.0.0.1"
DEFAULT_IDLE_S = 600.0  # a demo's evals come every sensor tick (15 s); a quiet hour should not hold the memory
DEFAULT_START_S = 300.0  # the torch import alone takes a minute on a loaded 2-core machine
DEFAULT_EVAL_S = 3600.0  # one eval's answer; a crashed server's closed socket ends the wait at once
MAX_BODY = 64 * 1024
FIELDS = {"run_id": str, "step": int, "benchmark": str}


class EvalServerUnavailable(RuntimeError):
    """No eval server could be reached or started, or it failed without a verdict: evaluate in-process."""


@dataclass(frozen=True)
class ServerInfo:
    pid: int
    port: int
    home: str


def info_path(paths: FactoryPaths) -> Path:
    return paths.root / "run" / "eval-server.json"


def _lock_path(paths: FactoryPaths) -> Path:
    return paths.root / "run" / "eval-server.lock"


def log_path(paths: FactoryPaths) -> Path:
    return paths.root / "run" / "eval-server.log"


def remove_info(paths: FactoryPaths, pid: int) -> None:
    """Remove the discovery file if it still names `pid` (a newer server may have replaced it)."""
    path = info_path(paths)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


# ---------------------------------------------------------------- client (torch-free)


def _request(info: ServerInfo, method: str, path: str, body: dict | None, timeout_s: float) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(HOST, info.port, timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"error": raw[:500].decode(errors="replace")}
    finally:
        conn.close()


def live_server(paths: FactoryPaths) -> ServerInfo | None:
    """The running server of this home, if its discovery file names a live one that says so itself."""
    try:
        info = ServerInfo(**json.loads(info_path(paths).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    try:
        os.kill(info.pid, 0)
        status, body = _request(info, "GET", "/health", None, timeout_s=10.0)
    except (OSError, http.client.HTTPException):
        return None
    if status != 200 or body.get("pid") != info.pid or body.get("home") != str(paths.root):
        return None
    return info


def start_server(paths: FactoryPaths, idle_s: float = DEFAULT_IDLE_S, start_s: float = DEFAULT_START_S) -> ServerInfo:
    """The home's live server, started as a detached process (its own session, so it outlives the run worker that
    starts it) when there is none; under the home's lock, so concurrent callers share one. EvalServerUnavailable
    when it exits or is not ready within `start_s` (then it is stopped: no half-started server is left)."""
    with file_lock(_lock_path(paths)):
        info = live_server(paths)
        if info is not None:
            return info
        log = log_path(paths)
        log.parent.mkdir(parents=True, exist_ok=True)
        # the server imports the same factory package as this process (a checkout's, not an installed copy)
        here = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "factory.runs.eval_serve", "--home", str(paths.root), "--idle-s", str(idle_s)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, close_fds=True, env=env)
        deadline = time.monotonic() + start_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EvalServerUnavailable(f"the eval server exited with code {proc.returncode} while starting; "
                                            f"its log: {log}\n{_tail(log)}")
            info = live_server(paths)
            if info is not None and info.pid == proc.pid:
                return info
            time.sleep(0.2)  # a process's start-up has no event to wait on; bounded by `start_s`
        proc.kill()
        proc.wait()
        raise EvalServerUnavailable(f"the eval server was not ready within {start_s:.0f} s; its log: {log}")


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def evaluate_remote(paths: FactoryPaths, run_id: str, step: int, benchmark: str, *, tolerance: float | None = None,
                    start: bool = True, eval_s: float = DEFAULT_EVAL_S) -> DrawnEval:
    """`evaluate_and_draw` done by the home's eval server (started if `start` and none runs). The
    server's verdicts on the request raise as in-process (LookupError, ValueError, same message);
    EvalServerUnavailable when no server answers with a verdict (none started, it crashed mid-eval, it failed):
    the caller evaluates in-process instead."""
    info = live_server(paths)
    if info is None:
        if not start:
            raise EvalServerUnavailable(f"no eval server runs for {paths.root}")
        info = start_server(paths)
    try:
        status, body = _request(info, "POST", "/eval", {"run_id": run_id, "step": step, "benchmark": benchmark,
                                                        "tolerance": tolerance}, timeout_s=eval_s)
    except (OSError, http.client.HTTPException) as e:
        raise EvalServerUnavailable(f"the eval server (pid {info.pid}) gave no answer: {type(e).__name__}: {e}") \
            from None
    if status == 200:
        picture, reg = body.get("picture"), body.get("regression")
        return DrawnEval(CheckpointEval(**body["result"]), None if picture is None else base64.b64decode(picture),
                         body.get("evals_url"), None if reg is None else RegressionCheck(**reg))
    error = body.get("error", "")
    if status == 404 and body.get("kind") == "LookupError":
        raise LookupError(error)
    if status == 422 and body.get("kind") == "ValueError":
        raise ValueError(error)
    raise EvalServerUnavailable(f"the eval server (pid {info.pid}) answered {status}: {error}")


def stop_server(paths: FactoryPaths, wait_s: float = 30.0) -> int | None:
    """SIGTERM the home's live server and wait (bounded) for it to exit; its pid, or None when none ran."""
    info = live_server(paths)
    if info is None:
        return None
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _alive(info.pid):
        time.sleep(0.1)  # another process's exit has nothing to wait on here; bounded by `wait_s`
    if _alive(info.pid):
        os.kill(info.pid, signal.SIGKILL)
    remove_info(paths, info.pid)
    return info.pid


def _alive(pid: int) -> bool:
    """Running (a zombie is not): our own child is reaped here, another process's read from /proc."""
    try:
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
