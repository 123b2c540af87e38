"""Checkpoints on an object store (FACTORY_CHECKPOINT_URI=s3://bucket/prefix or gs://...): publish a saved checkpoint
version there, and fetch one back into a verified local cache.

Layout: a checkpoint is published under `<base>/<name>/<sha256>/` (its files at their relative names) and is
immutable there: the sha256 (factory/digest.dir_digest) names its contents. The manifest `MANIFEST_NAME`, listing
every file with its size and sha256 and the whole digest, is uploaded last, after every file: a checkpoint whose
upload died midway has files but no manifest, and readers refuse it. Object PUTs are atomic, so a manifest is never
seen half-written. Publishing a digest whose manifest is already there uploads nothing.

Fetching downloads into a temp directory beside the cache entry, checks each file's size and sha256 and the whole
digest against the manifest, then renames it to `<cache>/<sha256>` (FACTORY_HOME/cache/checkpoints): a cache entry
exists only complete and verified, so the next fetch of that digest reuses it without downloading or re-hashing.
Two processes fetching at once each download, and the loser of the rename drops its copy. Nothing evicts old cache
entries yet.

pyarrow.fs rather than fsspec/s3fs: pyarrow is already a dependency (pyiceberg's FileIO uses it), has native S3 and
GCS clients, and streams files in chunks; s3fs would add aiobotocore for the same calls. Tested against moto's S3
server on 127.0.0.1; real AWS S3 and GCS are not exercised by the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from factory.digest import dir_digest, hash_files, manifest_entries, tree_files
from factory.digest import manifest as tree_manifest
from factory.home import factory_home
from factory.infra.liveness import pulse
from factory.objstore import check_uri, filesystem, is_remote

CHECKPOINT_URI_ENV = "FACTORY_CHECKPOINT_URI"
MANIFEST_NAME = "factory_manifest.json"
_CHUNK = 8 << 20


class IncompleteCheckpointError(FileNotFoundError):
    """An object-store checkpoint without its manifest (an upload that never finished, or not a Factory checkpoint),
    or whose files do not match it."""


def checkpoint_store_uri() -> str | None:
    """$FACTORY_CHECKPOINT_URI, checked (s3:// or gs://, no trailing slash); None when checkpoints stay local."""
    uri = os.environ.get(CHECKPOINT_URI_ENV) or None
    return check_uri(uri, CHECKPOINT_URI_ENV) if uri is not None else None


def upload_checkpoint(root: Path, base_uri: str, name: str, digest: str | None = None,
                      shown: str | Path | None = None) -> str:
    """Upload the checkpoint version directory `root` to `<base_uri>/<name>/<sha256>`, manifest last; return that
    URI. The caller holds `root` against deletion (`models/checkpoint.publish_checkpoint`). `digest`, if given, is
    what the caller recorded for it (save_checkpoint's sha256): a version whose files hash otherwise is refused
    rather than published under the wrong name. Errors name the checkpoint `shown` (default: `root`)."""
    files = tree_files(root)
    tree = hash_files(files, root, per_file=True)
    if digest is not None and tree.sha256 != digest:
        raise ValueError(f"checkpoint {shown or root}: files hash to {tree.sha256[:12]}..., not the recorded "
                         f"{digest[:12]}...; nothing published")
    uri = f"{base_uri.rstrip('/')}/{name.strip('/')}/{tree.sha256}"
    fs, base = filesystem(uri)
    if fs.get_file_info(f"{base}/{MANIFEST_NAME}").type == pafs.FileType.File:
        return uri  # already published: same digest, same files
    for f, e in zip(files, tree.files, strict=True):
        with f.open("rb") as src, fs.open_output_stream(f"{base}/{e['path']}") as dst:
            while chunk := src.read(_CHUNK):
                dst.write(chunk)
                pulse()  # a run that waits for its uploads is alive while bytes move (infra/liveness.py)
    with fs.open_output_stream(f"{base}/{MANIFEST_NAME}") as out:  # the marker: written after every file
        out.write(json.dumps(tree_manifest(tree), indent=2).encode())
    return uri


def read_manifest(uri: str) -> dict[str, Any]:
    """The manifest of the published checkpoint at `uri`; IncompleteCheckpointError if it has none."""
    fs, base = filesystem(uri)
    try:
        with fs.open_input_stream(f"{base}/{MANIFEST_NAME}") as f:
            return json.loads(f.read())
    except FileNotFoundError as e:
        listed = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        what = (f"{len(listed)} object(s) but no {MANIFEST_NAME}: an upload that did not finish, or not a "
                "checkpoint published by Factory" if listed else "nothing there")
        raise IncompleteCheckpointError(f"checkpoint {uri}: {what}; refusing to load it") from e


def fetch_checkpoint(uri: str, cache: str | Path | None = None) -> Path:
    """A local directory holding the published checkpoint at `uri`, verified against its manifest: the cache entry
    `<cache>/<sha256>` (default: FACTORY_HOME's checkpoint_cache, cache/checkpoints), downloaded first if missing."""
    if not is_remote(uri):
        raise ValueError(f"not an object-store checkpoint URI: {uri!r} (expected s3:// or gs://)")
    uri = uri.rstrip("/")
    manifest = read_manifest(uri)
    digest = manifest["sha256"]
    if uri.rsplit("/", 1)[1] != digest:
        raise IncompleteCheckpointError(f"checkpoint {uri}: its manifest names digest {digest[:12]}..., not the "
                                        "one in its URI; refusing it")
    cache = Path(cache) if cache is not None else factory_home().checkpoint_cache
    final = cache / digest
    if final.is_dir():
        return final  # only complete, verified downloads are ever renamed here
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.", dir=cache))
    try:
        _download(uri, manifest, tmp)
        got, _ = dir_digest(tmp)
        if got != digest:
            raise IncompleteCheckpointError(f"checkpoint {uri}: downloaded files hash to {got[:12]}..., the manifest "
                                            f"says {digest[:12]}...; refusing it")
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished the same download first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _download(uri: str, manifest: dict[str, Any], into: Path) -> None:
    fs, base = filesystem(uri)
    for e in manifest_entries(manifest):
        rel = e["path"]
        if rel.startswith("/") or ".." in rel.split("/"):
            raise IncompleteCheckpointError(f"checkpoint {uri}: manifest names a file outside it: {rel!r}")
        dest = into / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        h, size = hashlib.sha256(), 0
        try:
            with fs.open_input_stream(f"{base}/{rel}") as src, dest.open("wb") as out:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
        except FileNotFoundError as err:
            raise IncompleteCheckpointError(f"checkpoint {uri}: {rel} is listed in its manifest but missing "
                                            "from the store") from err
        if size != e["bytes"] or h.hexdigest() != e["sha256"]:
            raise IncompleteCheckpointError(f"checkpoint {uri}: {rel} does not match its manifest "
                                            f"({size} bytes, sha256 {h.hexdigest()[:12]}...; expected {e['bytes']} "
                                            f"bytes, {e['sha256'][:12]}...)")
