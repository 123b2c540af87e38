"""`factory env-serve` and `sandbox-serve`: environment workers and a sandbox pool over HTTP until interrupted."""

from __future__ import annotations

import argparse
import sys

from factory.cli.common import error
from factory.envs import sandbox_service, service
from factory.envs.sandbox import IsolationUnavailable
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
