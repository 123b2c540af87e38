"""The eval server: one long-lived process that evaluates many recorded checkpoints, so a periodic eval does not
pay a process start, the torch/transformers imports and the lake's opening per partition.

`serve` (run as `factory eval-serve` or `python -m factory.runs.eval_server`) binds 127.0.0.1 and answers
`POST /eval {"run_id", "step", "benchmark", "tolerance"}` with what `evaluate_and_draw` returns in-process: the
eval's record, the run's redrawn evals-by-step picture and the regression check (the same function, so the same
digest check, reuse of recorded rows, rows written to `evals`, picture stored on the MLflow run, and generated
code scored through the sandbox pool as every eval does); `GET /health` says who it is. Evals run one at a time;
the server exits after `idle_s` without a request.

The client side (`evaluate_remote`, `live_server`, `start_server`) imports neither torch nor mlflow nor matplotlib:
the `checkpoint_eval` asset's run worker imports only this module's top. A server is found through
`<FACTORY_HOME>/run/eval-server.json` (its pid and port), checked alive by `GET /health` (pid and home must match:
a reused pid or another home's server is not it), and started on demand as a detached process under a file lock,
so two evals never start two servers.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from factory.home import FactoryPaths, factory_home, file_lock
from factory.infra.faults import fault_point
from factory.runs.checkpoint_eval import CheckpointEval, DrawnEval, RegressionCheck, evaluate_and_draw

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


# ---------------------------------------------------------------- server


class _State:
    """What the handler threads share: the home, the lake (opened once), the one-eval-at-a-time lock and the time
    of the last request (the idle timer's)."""

    def __init__(self, paths: FactoryPaths) -> None:
        from factory.cockpit.tracking import Tracker  # noqa: PLC0415 heavy: mlflow; the server's, not its clients'
        from factory.lake.writer import Lake  # noqa: PLC0415 heavy: duckdb; the server's, not its clients'

        self.paths = paths
        self.lake = Lake.open(paths)
        self.tracker = Tracker(paths)
        self.eval_lock = threading.Lock()
        self.last = time.monotonic()
        self.busy = 0
        self.served = 0


def _parse(body: bytes) -> dict[str, Any]:
    """The request's fields, or ValueError naming the field that is missing or of the wrong type."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"body: not JSON ({e})") from None
    if not isinstance(req, dict):
        raise ValueError(f"body: expected a JSON object with {', '.join(FIELDS)}, got {type(req).__name__}")
    for name, kind in FIELDS.items():
        value = req.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}")
    if req["step"] < 0:
        raise ValueError(f"step: expected >= 0, got {req['step']}")
    tolerance = req.get("tolerance")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, int | float)
                                  or not 0 <= tolerance <= 1):
        raise ValueError(f"tolerance: expected a number in [0, 1] or null, got {tolerance!r}")
    return {**{k: req[k] for k in FIELDS}, "tolerance": tolerance}


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
            print(f"eval-server: {format % args}", file=sys.stderr, flush=True)

        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path != "/health":
                self._send(404, {"error": f"no such path {self.path!r}; try GET /health or POST /eval"})
                return
            self._send(200, {"pid": os.getpid(), "home": str(state.paths.root), "busy": state.busy,
                             "served": state.served})

        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            state.last = time.monotonic()
            if self.path != "/eval":
                self._send(404, {"error": f"no such path {self.path!r}; try POST /eval"})
                return
            try:
                size = int(self.headers.get("Content-Length") or "")
            except ValueError:
                self._send(411, {"error": "Content-Length: expected the body's size in bytes"})
                return
            if not 0 <= size <= MAX_BODY:
                self._send(413, {"error": f"Content-Length: expected at most {MAX_BODY} bytes, got {size}"})
                return
            try:
                req = _parse(self.rfile.read(size))
            except ValueError as e:
                self._send(400, {"error": str(e)})
                return
            self._send(*_evaluate(state, req))

    return Handler


def _evaluate(state: _State, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One eval, in turn with the others: 200 and the record, 404 for a checkpoint or run that is not recorded,
    422 for one that cannot be evaluated as asked (digest mismatch, unknown benchmark), 500 for anything else."""
    with state.eval_lock:
        state.busy += 1
        try:
            fault_point("eval_server_eval")  # a test's crash of the server mid-eval (FACTORY_FAULT_KILL)
            drawn = evaluate_and_draw(state.paths, state.lake, state.tracker, req["run_id"], req["step"],
                                      req["benchmark"], req["tolerance"])
        except LookupError as e:
            return 404, {"error": str(e), "kind": "LookupError"}
        except ValueError as e:
            return 422, {"error": str(e), "kind": "ValueError"}
        except Exception as e:  # noqa: BLE001 - the caller decides; the server keeps serving
            return 500, {"error": f"{type(e).__name__}: {e}"}
        finally:
            state.busy -= 1
            state.last = time.monotonic()
        state.served += 1
        picture = None if drawn.picture is None else base64.b64encode(drawn.picture).decode("ascii")
        return 200, {"result": asdict(drawn.result), "picture": picture, "evals_url": drawn.evals_url,
                     "regression": None if drawn.regression is None else asdict(drawn.regression)}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        # HTTPServer's own looks up the host's fully qualified name, which can stall where DNS is unreachable
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = HOST, self.server_address[1]


def serve(paths: FactoryPaths, port: int = 0, idle_s: float = DEFAULT_IDLE_S) -> None:
    """Serve evals of `paths`' checkpoints on 127.0.0.1:`port` (0: any free port) until `idle_s` pass without a
    request (0: never) or SIGTERM/SIGINT; the discovery file is written once the heavy imports are done and
    removed on the way out when it is still this process's."""
    # Loaded here, before saying "ready", so that the first eval does not pay them; the client functions of this
    # module (evaluate_remote, stop_server) are imported by callers that never load them.
    import factory.cockpit.reports  # noqa: F401, PLC0415 heavy: mlflow, matplotlib; the server's warm-up
    import factory.runs.stages  # noqa: F401, PLC0415 heavy: torch, transformers; the server's warm-up

    state = _State(paths)
    httpd = _Server((HOST, port), _handler(state))
    me = ServerInfo(os.getpid(), httpd.server_address[1], str(paths.root))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start())
    stop = threading.Event()

    def idle_watch() -> None:
        while not stop.wait(min(5.0, idle_s / 4)):
            if state.busy == 0 and time.monotonic() - state.last > idle_s:
                print(f"eval-server: idle for {idle_s:.0f} s; exiting", file=sys.stderr, flush=True)
                httpd.shutdown()
                return

    if idle_s > 0:
        threading.Thread(target=idle_watch, daemon=True, name="idle-watch").start()
    _write_info(paths, me)
    print(f"eval-server: pid {me.pid} serving {paths.root} on http://{HOST}:{me.port}", file=sys.stderr, flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        _remove_info(paths, me.pid)
        httpd.server_close()
        state.lake.close()


def _write_info(paths: FactoryPaths, me: ServerInfo) -> None:
    path = info_path(paths)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{me.pid}.tmp")
    tmp.write_text(json.dumps(asdict(me)))
    os.replace(tmp, path)  # atomic: a reader sees the old file or this one, never half


def _remove_info(paths: FactoryPaths, pid: int) -> None:
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
                [sys.executable, "-m", "factory.runs.eval_server", "--home", str(paths.root), "--idle-s", str(idle_s)],
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
    _remove_info(paths, info.pid)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="factory eval-serve", description=__doc__.splitlines()[0])
    p.add_argument("--home", help="FACTORY_HOME whose checkpoints it evaluates (default: $FACTORY_HOME)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: 0, any free one)")
    p.add_argument("--idle-s", type=float, default=DEFAULT_IDLE_S,
                   help=f"exit after this many seconds without a request; 0: never (default: {DEFAULT_IDLE_S:.0f})")
    args = p.parse_args(argv)
    if args.idle_s < 0:
        p.error(f"--idle-s: expected >= 0, got {args.idle_s}")
    serve(factory_home(args.home), port=args.port, idle_s=args.idle_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
