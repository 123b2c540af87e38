"""`factory bpe-model`: a small HF model directory built offline."""

from __future__ import annotations

import argparse
from pathlib import Path

from factory.cli.common import error
from factory.models.bpe import build_bpe_model_dir
from factory.runs.exit_codes import EXIT_BAD_INPUT, EXIT_OK


def cmd_bpe_model(args: argparse.Namespace) -> int:
    """Write a Qwen2 model directory with a byte-level BPE tokenizer and a ChatML template."""
    out = Path(args.dir)
    if out.exists() and any(out.iterdir()) and not args.force:
        error(f"{out}: exists and is not empty (--force writes over it)")
        return EXIT_BAD_INPUT
    try:
        path = build_bpe_model_dir(out, seed=args.seed, vocab_size=args.vocab_size, preset=args.preset,
                                   max_positions=args.max_positions)
    except (KeyError, ValueError) as e:
        error(f"bpe-model: {e}")
        return EXIT_BAD_INPUT
    print(f"wrote a Qwen2 model ({args.preset}, random init, seed {args.seed}) with a byte-level BPE tokenizer of "
          f"{args.vocab_size} tokens and a ChatML template to {path}; use it with --set model.path={path}")
    return EXIT_OK
