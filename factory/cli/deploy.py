"""`factory deploy render` and `factory deploy preflight`: Kubernetes manifests written to a directory, never
applied."""

from __future__ import annotations

import argparse
import sys

from factory.cli.common import add_spec, error, load
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


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("deploy", help="Kubernetes: render the manifests a spec needs (factory/deploy/)")
    deploy = p.add_subparsers(dest="deploy_command", required=True)
    p = deploy.add_parser("render", help="write every manifest Factory would create for a spec to --out, for "
                          "review and GitOps (nothing is applied to a cluster)")
    add_spec(p)
    p.add_argument("--out", required=True, help="directory to write (refused when not empty, unless --force)")
    p.add_argument("--profile", help="deploy profile YAML (image, namespace, node pools; default: built-in)")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.set_defaults(func=cmd_deploy_render)
    p = deploy.add_parser("preflight", help="write RBAC and one Job per node that preflights it and marks it "
                          "(a failed node is tainted so training avoids it); nothing is applied")
    p.add_argument("--nodes", required=True, help="comma-separated node names, e.g. gpu-node-1,gpu-node-2")
    p.add_argument("--out", required=True, help="directory to write (refused when not empty, unless --force)")
    p.add_argument("--profile", help="deploy profile YAML (image, namespace, train pool; default: built-in)")
    p.add_argument("--spec", help="experiment spec: its ConfigMap is mounted and its GPUs per training pod requested "
                   "(default: the profile's gpus_per_train_pod)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a --spec field (repeatable)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs each Job requests (default: a training pod's); a node's "
                   "whole count tests every GPU")
    p.add_argument("--deep", action="store_true", help="the Jobs run the deep preflight")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out")
    p.set_defaults(func=cmd_deploy_preflight)
