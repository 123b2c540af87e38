"""The eval server's process (`factory eval-serve`, `python -m factory.runs.eval_serve`): `serve` binds 127.0.0.1,
answers `GET /health` and `POST /eval` one eval at a time, and exits after `idle_s` without a request. Its client, the
discovery file and the protocol's constants are eval_server.py, which the asset's run worker imports without this
module's imports (torch, transformers, mlflow, matplotlib, the lake), paid here once at start, before the server says
it is ready, so that the first eval does not pay them.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socketserver
import sys
import threading
import time
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import factory.cockpit.reports  # noqa: F401 - heavy (mlflow, matplotlib): loaded before the server says it is ready
import factory.runs.stages  # noqa: F401 - heavy (torch, transformers): loaded before the server says it is ready
from factory.cockpit.tracking import Tracker
from factory.home import FactoryPaths, factory_home
from factory.infra.faults import fault_point
from factory.lake.writer import Lake
from factory.runs.checkpoint_eval import evaluate_and_draw
from factory.runs.eval_server import DEFAULT_IDLE_S, FIELDS, HOST, MAX_BODY, ServerInfo, info_path, remove_info


class _State:
    """What the handler threads share: the home, the lake (opened once), the one-eval-at-a-time lock and the time
    of the last request (the idle timer's)."""

    def __init__(self, paths: FactoryPaths) -> None:
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
        remove_info(paths, me.pid)
        httpd.server_close()
        state.lake.close()


def _write_info(paths: FactoryPaths, me: ServerInfo) -> None:
    path = info_path(paths)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{me.pid}.tmp")
    tmp.write_text(json.dumps(asdict(me)))
    os.replace(tmp, path)  # atomic: a reader sees the old file or this one, never half


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
