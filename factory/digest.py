"""Content digests of directory trees (model directories, checkpoints, resume points) and the one manifest
format that lists a tree's files: one sha256 over every file's relative name and bytes, files in sorted order,
so two trees with the same digest hold the same files.

`hash_files` is the one implementation; `dir_digest` (checkpoints: the sha256 recorded in the lake and the
name a checkpoint is published under) and `model_dir_digest` (a `model.path` directory: part of the SFT warm
start's key) are its two uses. They differ only in what names are relative to: the tree's root for
`dir_digest`, the files' common folder for `model_dir_digest` (as recorded keys were computed; the two agree
whenever the root holds files in more than one place, as every model directory does).

A manifest (`manifest`) is `{"format": 2, "sha256", "bytes", "files": [{"path", "bytes", "sha256"}, ...]}` plus
what its writer adds (a resume point's `step`). `manifest_entries` also reads the two format-1 manifests written
before there was one format: a published checkpoint's (the same fields) and a resume point's (`files` a mapping
of name -> {sha256, bytes}, no whole digest).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20
MANIFEST_FORMAT = 2


@dataclass(frozen=True)
class TreeDigest:
    sha256: str  # of every file's relative name and bytes, in the given order
    bytes: int
    files: list[dict[str, Any]]  # per file {path, bytes, sha256}, when asked for (else empty)


def _digest(named: Iterable[tuple[str, Iterable[bytes]]], per_file: bool) -> TreeDigest:
    whole = hashlib.sha256()
    total, entries = 0, []
    for rel, chunks in named:
        whole.update(rel.encode() + b"\0")
        h, size = hashlib.sha256() if per_file else None, 0
        for chunk in chunks:
            whole.update(chunk)
            size += len(chunk)
            if h is not None:
                h.update(chunk)
        total += size
        if h is not None:
            entries.append({"path": rel, "bytes": size, "sha256": h.hexdigest()})
    return TreeDigest(whole.hexdigest(), total, entries)


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        yield from iter(lambda: fh.read(_CHUNK), b"")


def hash_files(files: list[Path], names_from: str | Path, per_file: bool = False) -> TreeDigest:
    """The digest of `files` (in this order), each named relative to `names_from`; with `per_file`, each file's
    own sha256 and size as well, from the same read."""
    return _digest(((os.path.relpath(f, names_from), _chunks(f)) for f in files), per_file)


def hash_blobs(blobs: dict[str, bytes]) -> TreeDigest:
    """The digest, with per-file entries, of the tree that writing `blobs` (relative name -> bytes) would make."""
    return _digest(((name, [blobs[name]]) for name in sorted(blobs)), per_file=True)


def manifest(tree: TreeDigest, **extra: Any) -> dict[str, Any]:
    """The manifest of a tree hashed with per-file entries, plus `extra` fields."""
    return {"format": MANIFEST_FORMAT, "sha256": tree.sha256, "bytes": tree.bytes, "files": tree.files, **extra}


def manifest_entries(m: dict[str, Any]) -> list[dict[str, Any]]:
    """A manifest's per-file entries ({path, bytes, sha256}), from this format or a format-1 one; ValueError for
    any other format."""
    if m.get("format") not in (1, MANIFEST_FORMAT):
        raise ValueError(f"format {m.get('format')!r}, expected {MANIFEST_FORMAT} (or 1)")
    files = m["files"]
    if isinstance(files, dict):  # a format-1 resume point's
        return [{"path": name, "bytes": e["bytes"], "sha256": e["sha256"]} for name, e in files.items()]
    return list(files)


def tree_files(root: Path) -> list[Path]:
    """Every file under `root`, in digest order."""
    return sorted(p for p in root.rglob("*") if p.is_file())


def dir_digest(path: str | Path) -> tuple[str, int]:
    """sha256 over sorted relative file names and contents, and the total byte count. A checkpoint link is
    followed once, so the digest is of one version even if the path is saved again meanwhile."""
    root = Path(path).resolve()
    d = hash_files(tree_files(root), root)
    return d.sha256, d.bytes


def model_dir_digest(path: str | Path) -> str | None:
    """sha256 of a model directory's files (names and contents), or of a single model file (a `.gguf`: its name
    and bytes), or None if there is neither. The SFT warm start is keyed by it
    (`ExperimentSpec.warm_start_fingerprint`), so a model saved again under the same path is trained from again
    instead of reusing a warm start made from other weights. Memoized on the files' names, sizes and mtimes, so a
    multi-GB model is read once per process, not on every call."""
    root = Path(path).expanduser()
    if root.is_file():
        files = [root.resolve()]
    elif root.is_dir():
        files = tree_files(root.resolve())
    else:
        return None
    stats = tuple((f.as_posix(), st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)])
    return _model_digest(stats)


@lru_cache(maxsize=64)
def _model_digest(stats: tuple[tuple[str, int, int], ...]) -> str:
    names = [name for name, _, _ in stats]
    return hash_files([Path(n) for n in names], os.path.commonpath(names) if names else "").sha256
