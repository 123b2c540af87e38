"""`factory preflight`: this node's preflight checks, recorded in `node_health`, optionally marked on its
Kubernetes node."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from factory.cli.common import error, home_from
from factory.config import SpecError, load_spec
from factory.ops.preflight import format_checks, run_preflight
from factory.ops.preflight.mark import LABEL, MarkError, mark_node
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK


def cmd_preflight(args: argparse.Namespace) -> int:
    """Run this node's preflight checks, print them, record them in `node_health`; exit 1 naming each failed check.
    With --mark-node, then label/taint/annotate the Kubernetes node $NODE_NAME with the outcome
    (factory/ops/preflight/mark.py)."""
    node = os.environ.get("NODE_NAME", "").strip()
    if args.mark_node and not node:  # checked first: no point measuring a node that cannot then be marked
        error("--mark-node: $NODE_NAME is not set (the preflight Job sets it from spec.nodeName)")
        return EXIT_BAD_INPUT
    log = (lambda m: print(m, file=sys.stderr)) if args.verbose else (lambda _: None)
    spec_path = None
    if args.spec is not None:  # read now: a bad spec is bad input, not a failed check
        try:
            load_spec(args.spec)
        except SpecError as e:
            print(str(e), file=sys.stderr)
            return EXIT_BAD_INPUT
        spec_path = str(Path(args.spec).resolve())  # the check's child process may run elsewhere
    try:
        report = run_preflight(home_from(args), mode="deep" if args.deep else "quick", only=args.checks or None,
                               kind=args.kind, record=not args.no_record, log=log, spec_path=spec_path)
    except ValueError as e:
        error(str(e))
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"preflight {report.preflight_id} on {report.node} ({report.kind}, {report.mode}) at "
              f"{report.started_at:%Y-%m-%d %H:%M:%S} UTC, {report.seconds:.1f} s: "
              f"{'passed' if report.passed else 'FAILED'}")
        print(format_checks(report.results))
    if report.record_error:
        error(f"preflight results not recorded in the lake: {report.record_error}")
    for r in report.failed:
        error(f"preflight check failed: {r.line()}")
    if args.mark_node:
        try:
            marked = mark_node(node, report, partial=bool(args.checks), kubeconfig=args.kubeconfig)
        except MarkError as e:
            error(str(e))
            return EXIT_FAILED
        print(f"node {node} marked {LABEL}={marked['metadata']['labels'][LABEL]}", file=sys.stderr)
    return EXIT_OK if report.passed else EXIT_FAILED
