"""`factory bpe-model` (a small HF model directory built offline) and `factory models import` (a `model.path`
value resolved ahead of a run)."""

from __future__ import annotations

import argparse
from pathlib import Path

from factory.cli.common import error, home_from
from factory.model_source import ModelPathError, model_source
from factory.models.bpe import build_bpe_model_dir
from factory.models.gguf import GGUFError
from factory.models.hf import ModelDirError, load_tokenizer_dir
from factory.models.resolve import resolve_model_path
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


FORMS = {"dir": "model directory", "gguf": "GGUF file", "hub": "Hugging Face Hub model"}


def cmd_models_import(args: argparse.Namespace) -> int:
    """Resolve SRC as `model.path` would (converting a .gguf file now, once), check its tokenizer loads, and print
    the directory; either SRC or the directory then works as `--set model.path=`."""
    try:
        src = model_source(args.src)
        out = resolve_model_path(args.src, home_from(args))
        load_tokenizer_dir(out)  # a tokenizer without eos would only be refused when a run starts
    except (ModelDirError, GGUFError, ModelPathError) as e:
        error(str(e))
        return EXIT_BAD_INPUT
    print(f"{FORMS[src.kind]} {args.src}: {out}")
    if src.kind == "dir":
        print(f"use it with --set model.path={args.src}")
    else:
        print(f"use it with --set model.path={args.src} (resolved to the directory above, "
              f"{'not converted again' if src.kind == 'gguf' else 'read from the cache'}) or --set model.path={out}")
    return EXIT_OK
