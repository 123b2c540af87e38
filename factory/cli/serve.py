"""`factory serve`: a policy over the OpenAI API until interrupted."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from factory.cli.common import error, home_from
from factory.core.rollout.engines.kv_budget import mib
from factory.core.rollout.engines.paged.engine import make_engine
from factory.core.rollout.server.api import POLICY_NAME
from factory.core.rollout.server.app import engine_from_checkpoint, serve
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
    if args.kv_budget_mb is not None and args.kv_budget_mb < 1:
        error(f"--kv-budget-mb: want a number of MiB >= 1, got {args.kv_budget_mb}")
        return EXIT_BAD_INPUT
    budget = None if args.kv_budget_mb is None else args.kv_budget_mb << 20
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
                                            version=args.weight_version, device=device, precision=args.precision,
                                            kv_budget=budget, engine=args.engine)
        else:
            tok = build_tokenizer()
            engine = make_engine(build_model(args.preset, tok, seed=args.seed).to(device), tok, args.engine,
                                 weight_version=args.weight_version, max_batch=args.max_batch,
                                 max_seq_len=args.max_seq_len, name=args.preset, precision=args.precision,
                                 kv_budget=budget, owns_model=True)
    except (FileNotFoundError, ValueError, OSError) as e:
        error(str(e))
        return EXIT_BAD_INPUT
    names = args.served_model_name or [engine.name]
    shown = ", ".join(dict.fromkeys([*names, POLICY_NAME]))
    print(f"factory: serving {engine.name} (weight version {engine.weight_version}; model names: {shown}) on "
          f"{describe(device)} at http://{args.host}:{args.port} with the {engine.info()['engine']} engine; KV cache "
          f"budget {mib(engine.kv.total_bytes)} ({engine.kv.columns:,} tokens of {engine.kv.per_token:,} bytes)",
          file=sys.stderr)
    serve(engine, host=args.host, port=args.port, model_path=args.checkpoint, max_body_bytes=args.max_body_mb,
          max_update_bytes=args.max_update_mb, model_names=names)
    return EXIT_OK
