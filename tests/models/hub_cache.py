"""A Hugging Face Hub cache built on disk the way huggingface_hub lays one out (no download): for `org/name`,
models--org--name/blobs/<sha256> holding each file, snapshots/<commit>/<file> linking to its blob, refs/<branch>
holding the commit."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_snapshot(cache: Path, repo: str, model_dir: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put the files of `model_dir` into `cache` as snapshot `commit` (40 hex digits) of `repo`, with `refs`
    pointing at it; the snapshot directory."""
    assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit), commit
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot
