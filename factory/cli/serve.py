"""`factory serve`: a policy over the OpenAI API until interrupted."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from factory.cli.common import error, home_from
from factory.core.rollout.continuous import ContinuousEngine
from factory.core.rollout.server import engine_from_checkpoint, serve
from factory.infra.device import describe, prepare, resolve_device
from factory.model_source import model_source
from factory.models.build import build_model
from factory.models.resolve import resolve_model_path
from factory.models.tokenizer import build_tokenizer
from factory.objstore import is_remote
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint (or a freshly built preset model) over the OpenAI API until interrupted."""
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device, field="--device")
        prepare(device)
        if args.checkpoint:
            # A .gguf file or a cached hub id names a directory the way model.path does (models/resolve.py); a
            # directory or an object-store URI is load_checkpoint's to read.
            path = args.checkpoint
            source = model_source(path)
            if source.kind == "dir" and not is_remote(path) and not Path(path).expanduser().is_dir():
                # said now, not after load_checkpoint's retries for a checkpoint being replaced
                error(f"--checkpoint: {path} is not a directory (expected an HF-format checkpoint directory, a "
                      f".gguf file, a cached hub id org/name or an s3:// / gs:// URI)")
                return EXIT_BAD_INPUT
            if source.kind != "dir":
                path = resolve_model_path(path, home_from(args), log=lambda m: print(m, file=sys.stderr))
            engine = engine_from_checkpoint(path, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                                            version=args.weight_version, device=device, precision=args.precision)
        else:
            tok = build_tokenizer()
            engine = ContinuousEngine(build_model(args.preset, tok, seed=args.seed).to(device), tok,
                                      args.weight_version, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                                      name=args.preset, precision=args.precision)
    except (FileNotFoundError, ValueError, OSError) as e:
        error(str(e))
        return EXIT_BAD_INPUT
    print(f"factory: serving {engine.name} (weight version {engine.weight_version}) on {describe(device)} at "
          f"http://{args.host}:{args.port}", file=sys.stderr)
    serve(engine, host=args.host, port=args.port, model_path=args.checkpoint, max_body_bytes=args.max_body_mb,
          max_update_bytes=args.max_update_mb)
    return EXIT_OK
