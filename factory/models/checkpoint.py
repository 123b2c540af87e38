"""HF-format checkpoints (config.json, model.safetensors, tokenizer files), written atomically.

A checkpoint directory appears complete or not at all: files go to a temp sibling first, then
one `rename`. Its sha256 covers every file's name and bytes, so two checkpoints with the same
sha256 hold the same weights and tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

# Per-file progress bars for a one-file checkpoint only clutter the training log.
hf_logging.disable_progress_bar()

META_FILE = "factory_meta.json"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    sha256: str
    bytes: int


def dir_digest(path: Path) -> tuple[str, int]:
    """sha256 over sorted relative file names and contents, and the total byte count."""
    h = hashlib.sha256()
    total = 0
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        h.update(rel.encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
                total += len(chunk)
    return h.hexdigest(), total


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    path: str | Path,
    meta: dict[str, Any] | None = None,
) -> CheckpointInfo:
    """Write model + tokenizer (+ optional metadata) to `path` atomically; replace what was there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if meta is not None:
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        digest, size = dir_digest(tmp)
        if path.exists():
            # Two renames keep a complete checkpoint on disk at every instant.
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return CheckpointInfo(path=path, sha256=digest, bytes=size)


def load_checkpoint(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load a checkpoint written by `save_checkpoint` (or any HF causal-LM directory)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"not a checkpoint directory (no config.json): {path}")
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    return model, tokenizer


def read_meta(path: str | Path) -> dict[str, Any]:
    f = Path(path) / META_FILE
    return json.loads(f.read_text()) if f.is_file() else {}
