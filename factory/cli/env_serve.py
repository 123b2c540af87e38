"""`factory env-serve`, `sandbox-serve` and `eval-serve`: environment workers, a sandbox pool and checkpoint evals
over HTTP until interrupted."""

from __future__ import annotations

import argparse
import sys

from factory.cli.common import error
from factory.envs import sandbox_service, service
from factory.envs.sandbox import IsolationUnavailable
from factory.home import factory_home
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK


def cmd_env_serve(args: argparse.Namespace) -> int:
    """Serve environment workers (episode scoring) over HTTP until interrupted."""
    if args.latency_unit < 0:
        error(f"--latency-unit: must be >= 0, got {args.latency_unit}")
        return EXIT_BAD_INPUT
    print(f"factory: environment workers on http://{args.host}:{args.port}", file=sys.stderr)
    service.serve(host=args.host, port=args.port, latency_unit_s=args.latency_unit, max_body_bytes=args.max_body_mb)
    return EXIT_OK


def cmd_sandbox_serve(args: argparse.Namespace) -> int:
    """Serve a sandbox pool (generated code execution) over HTTP until interrupted."""
    if args.size < 1:
        error(f"--size: must be >= 1, got {args.size}")
        return EXIT_BAD_INPUT
    print(f"factory: sandbox pool ({args.size} workers, isolation {args.isolation}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    try:
        sandbox_service.serve(host=args.host, port=args.port, size=args.size, isolation=args.isolation,
              max_body_bytes=args.max_body_mb)
    except IsolationUnavailable as e:
        error(str(e))
        return EXIT_FAILED
    return EXIT_OK


def cmd_eval_serve(args: argparse.Namespace) -> int:
    """Serve checkpoint evals of FACTORY_HOME over HTTP on 127.0.0.1 until idle or interrupted."""
    if args.idle_s < 0:
        error(f"--idle-s: must be >= 0, got {args.idle_s}")
        return EXIT_BAD_INPUT
    if not 0 <= args.port <= 65535:
        error(f"--port: must be 0..65535, got {args.port}")
        return EXIT_BAD_INPUT
    from factory.runs.eval_serve import serve  # noqa: PLC0415 heavy: torch, mlflow; env-serve, sandbox-serve need none

    serve(factory_home(), port=args.port, idle_s=args.idle_s)
    return EXIT_OK
