"""`factory serve`, `env-serve`, `sandbox-serve`: the HTTP services (a policy, environment workers, a sandbox
pool), each until interrupted."""

from __future__ import annotations

import argparse
import sys

from factory.cli.common import add_max_body, error
from factory.envs.sandbox import IsolationUnavailable
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint (or a freshly built preset model) over the OpenAI API until interrupted."""
    import torch  # heavy: torch

    from factory.core.rollout.continuous import ContinuousEngine  # heavy: torch
    from factory.core.rollout.server import engine_from_checkpoint, serve  # heavy: torch, uvicorn

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.checkpoint:
            engine = engine_from_checkpoint(args.checkpoint, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                                            version=args.weight_version)
        else:
            from factory.models.build import build_model  # heavy: torch
            from factory.models.tokenizer import build_tokenizer  # heavy: transformers

            tok = build_tokenizer()
            engine = ContinuousEngine(build_model(args.preset, tok, seed=args.seed), tok, args.weight_version,
                                      max_batch=args.max_batch, max_seq_len=args.max_seq_len, name=args.preset)
    except (FileNotFoundError, ValueError, OSError) as e:
        error(str(e))
        return EXIT_BAD_INPUT
    print(f"factory: serving {engine.name} (weight version {engine.weight_version}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    serve(engine, host=args.host, port=args.port, model_path=args.checkpoint, max_body_bytes=args.max_body_mb,
          max_update_bytes=args.max_update_mb)
    return EXIT_OK


def cmd_env_serve(args: argparse.Namespace) -> int:
    """Serve environment workers (episode scoring) over HTTP until interrupted."""
    from factory.envs.service import serve  # heavy: uvicorn

    if args.latency_unit < 0:
        error(f"--latency-unit: must be >= 0, got {args.latency_unit}")
        return EXIT_BAD_INPUT
    print(f"factory: environment workers on http://{args.host}:{args.port}", file=sys.stderr)
    serve(host=args.host, port=args.port, latency_unit_s=args.latency_unit, max_body_bytes=args.max_body_mb)
    return EXIT_OK


def cmd_sandbox_serve(args: argparse.Namespace) -> int:
    """Serve a sandbox pool (generated code execution) over HTTP until interrupted."""
    from factory.envs.sandbox_service import serve  # heavy: uvicorn

    if args.size < 1:
        error(f"--size: must be >= 1, got {args.size}")
        return EXIT_BAD_INPUT
    print(f"factory: sandbox pool ({args.size} workers, isolation {args.isolation}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    try:
        serve(host=args.host, port=args.port, size=args.size, isolation=args.isolation,
              max_body_bytes=args.max_body_mb)
    except IsolationUnavailable as e:
        error(str(e))
        return EXIT_FAILED
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a policy over the OpenAI API (rollout server mode)",
                       description="OpenAI-compatible rollout server with SGLang-style control endpoints.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="HF-format checkpoint directory to serve")
    src.add_argument("--preset", help="serve a freshly initialised model of this preset (for trying the API)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    p.add_argument("--max-batch", type=int, default=64, help="sequences decoded together (default: 64)")
    p.add_argument("--max-seq-len", type=int, help="prompt + completion limit (default: the model's context)")
    p.add_argument("--weight-version", type=int, default=0, help="version tag of the served weights (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="init seed for --preset")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; on cores shared with "
                                               "other jobs 1 can be much faster)")
    add_max_body(p)
    add_max_body(p, "--max-update-mb", 16384, "a weight update (POST /update_weights_from_delta)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("env-serve", help="serve environment workers (episode scoring) over HTTP",
                       description="Environment workers: POST /score runs episodes side by side and returns rewards.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port (default: 8100)")
    p.add_argument("--latency-unit", type=float, default=0.0,
                   help="simulated heavy-tailed episode latency unit in seconds (envs/latency.py); 0: none")
    add_max_body(p)
    p.set_defaults(func=cmd_env_serve)

    p = sub.add_parser("sandbox-serve", help="serve a sandbox pool (runs generated code) over HTTP",
                       description="Sandbox pool: POST /run executes code in a warm, isolated worker and "
                                   "returns its result (factory/envs/sandbox_service.py).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8200, help="port (default: 8200)")
    p.add_argument("--size", type=int, default=4, help="warm workers (default: 4)")
    p.add_argument("--isolation", choices=("bwrap", "none"), default="bwrap",
                   help="bwrap: namespaces via bubblewrap (default); none: NOT isolated, for trusted code only")
    add_max_body(p)
    p.set_defaults(func=cmd_sandbox_serve)
