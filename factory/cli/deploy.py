"""`factory deploy render` and `factory deploy preflight`: Kubernetes manifests written to a directory, never
applied."""

from __future__ import annotations

import argparse
import sys

from factory.cli.common import error, load
from factory.deploy.preflight import parse_nodes, render_preflight
from factory.deploy.profile import ProfileError, load_profile
from factory.deploy.render import RenderError, render, write_manifests
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def cmd_deploy_render(args: argparse.Namespace) -> int:
    """Write every Kubernetes manifest Factory would create for a spec into --out (nothing is applied)."""
    spec, err = load(args)
    if err is not None:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT
    return _write_rendered(args, lambda profile: render(spec, profile))


def _write_rendered(args: argparse.Namespace, build) -> int:
    """`build(profile)`'s manifests written to --out, the profile from --profile; bad input named, exit 2."""
    try:
        written = write_manifests(build(load_profile(args.profile)), args.out, force=args.force)
    except ProfileError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    except RenderError as e:
        error(str(e))
        return EXIT_BAD_INPUT
    print(f"{len(written)} manifests written to {args.out}")
    return EXIT_OK


def cmd_deploy_preflight(args: argparse.Namespace) -> int:
    """Write the RBAC and one preflight Job per node into --out (deploy/preflight.py; nothing is applied)."""
    spec = None
    if args.spec:
        spec, err = load(args)
        if err is not None:
            print(str(err), file=sys.stderr)
            return EXIT_BAD_INPUT
    return _write_rendered(args, lambda profile: render_preflight(parse_nodes(args.nodes), profile, spec,
                                                                  deep=args.deep, gpus=args.gpus_per_node))
