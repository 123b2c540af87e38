"""`factory serve`: a policy over the OpenAI API until interrupted."""

from __future__ import annotations

import argparse
import sys

import torch

from factory.cli.common import error
from factory.core.rollout.continuous import ContinuousEngine
from factory.core.rollout.server import engine_from_checkpoint, serve
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint (or a freshly built preset model) over the OpenAI API until interrupted."""
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.checkpoint:
            engine = engine_from_checkpoint(args.checkpoint, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                                            version=args.weight_version)
        else:
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
