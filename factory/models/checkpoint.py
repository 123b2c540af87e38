"""HF-format checkpoints (config.json, model.safetensors, tokenizer files), hashed, and replaced so that a
checkpoint path holds a complete checkpoint at every instant.

Layout: `path` is a symlink to a versioned sibling directory `.<name>.v-XXXXXXXX` (a relative target, so
the two move together). A save writes and fsyncs a new version beside it, then swaps the link in one
rename(2) (the new link is made at a temp name, then os.replace'd over the old one), then deletes the old
version. A SIGKILL at any point leaves `path` at the old or the new complete version; what a killed saver
left (a partial version, a temp link) is removed by the next save of that path. A save holds an flock on
`.<name>.lock` throughout, so it never takes a live saver's files for a dead one's. A real directory at
`path` (homes written before this layout, or a copied checkpoint) is swapped for the link with Linux
renameat2(RENAME_EXCHANGE), atomic too; where the filesystem lacks it (NFS) the directory is moved aside
first: the one save, per such path, during which a reader can find `path` missing.

Readers: `load_checkpoint` resolves the link once and loads that version under a shared flock on its
directory, so it never mixes two versions and no save deletes the one it reads: a save deletes the version
it replaced only if nobody holds that lock, else the next save does. Tools that open `path` itself
(transformers' from_pretrained, SGLang) follow the link file by file. The sha256 covers every file's
relative name and bytes, so two checkpoints with the same sha256 hold the same weights and tokenizer.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from factory.digest import dir_digest
from factory.home import file_lock
from factory.infra.disk import DiskFull, is_disk_full
from factory.infra.faults import fault_point
from factory.infra.liveness import covered
from factory.infra.supervisor import retry
from factory.models import lora
from factory.models.checkpoint_store import checkpoint_store_uri, fetch_checkpoint, upload_checkpoint
from factory.objstore import is_remote

# Per-file progress bars for a one-file checkpoint only clutter the training log.
hf_logging.disable_progress_bar()

META_FILE = "factory_meta.json"
VERSION_TAG = "v-"  # .<name>.v-XXXXXXXX: one saved version of <name>
_LINK_TAG = "link-"  # .<name>.link-XXXXXXXX: the next link, before it is renamed over <name>
# Names left by saves that died midway, and by older Factory versions (`.<name>.old-<pid>` when killed between
# their two renames, `.<name>.XXXXXXXX` temp directories): removed by the next save of <name>.
_LEFTOVER = r"(?:v-[a-z0-9_]+|link-[a-z0-9_]+|old-\d+|[a-z0-9_]{8})"
_LOAD_ATTEMPTS = 5  # a reader loses its version to a newer save at most this often in a row


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    sha256: str
    bytes: int


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    path: str | Path,
    meta: dict[str, Any] | None = None,
) -> CheckpointInfo:
    """Write model + tokenizer (+ optional metadata) as a new version of `path` and switch `path` to it
    atomically (see the module docstring); the version it replaces is deleted."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_name(f".{path.name}.lock")):
        _remove_leftovers(path)
        new = Path(tempfile.mkdtemp(prefix=f".{path.name}.{VERSION_TAG}", dir=path.parent))
        try:
            fault_point("checkpoint_save", new / "model.safetensors")  # tests: a full disk at this write
            with covered():  # one long write of a large model: no loop of ours inside (infra/liveness.py)
                # A LoRA model is saved merged: a plain HF directory that transformers (and SGLang) load directly.
                (lora.merged_copy(model) if lora.attached(model) else model).save_pretrained(
                    new, safe_serialization=True)
                tokenizer.save_pretrained(new)
                if meta is not None:
                    (new / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
                digest, size = dir_digest(new)
                _fsync_tree(new)  # the link must never point at files a power cut could still lose
            _switch(path, new)
        except BaseException as e:
            if _version_of(path) != new:
                shutil.rmtree(new, ignore_errors=True)
            if isinstance(e, Exception) and is_disk_full(e) and not isinstance(e, DiskFull):
                # safetensors says it in a SafetensorError that names no file: name the directory here
                raise DiskFull(path.parent, e) from e
            raise
    return CheckpointInfo(path=path, sha256=digest, bytes=size)


def load_checkpoint(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load a checkpoint written by `save_checkpoint` (or any HF causal-LM directory): one whole version,
    even while `path` is saved again. An object-store URI (s3://, gs://: one published by models/checkpoint_store.py)
    is fetched into the local cache, verified against its manifest, and loaded from there."""
    if is_remote(path):
        model, tokenizer = load_checkpoint(fetch_checkpoint(str(path)))
        model.config._name_or_path = model.name_or_path = tokenizer.name_or_path = str(path)
        return model, tokenizer
    path = Path(path)
    if not path.exists():  # nothing to wait for: a save replaces the link, it never removes it
        raise FileNotFoundError(f"no checkpoint at {path} (no such file or directory)")

    def load_version() -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
        version = path.resolve()
        loaded = None
        with _reading(version) as pinned:
            if pinned:  # else a save is deleting the version we found: look again
                try:
                    if not (version / "config.json").is_file():
                        raise FileNotFoundError(f"not a checkpoint directory (no config.json): {path}")
                    with covered():  # one long read of a large model (infra/liveness.py)
                        loaded = (AutoModelForCausalLM.from_pretrained(version),
                                  PreTrainedTokenizerFast.from_pretrained(version))
                except Exception:
                    if path.resolve() == version:
                        raise  # not a save replacing it under us: a real error
                    # deleted between our lookup and our lock: load the new version
        if loaded is None:
            raise _Replaced(version)
        return loaded

    model, tokenizer = retry(load_version, attempts=_LOAD_ATTEMPTS, on=_Replaced, give_up=lambda e: RuntimeError(
        f"checkpoint {path} was replaced {_LOAD_ATTEMPTS} times while loading it"))
    # Name the checkpoint, not its version directory, as transformers would for `path` itself.
    model.config._name_or_path = model.name_or_path = str(path)
    tokenizer.name_or_path = str(path)
    return model, tokenizer


class _Replaced(Exception):
    """The version directory a reader looked up was replaced by a newer save before it could load it."""


def publish_checkpoint(local: str | Path, base_uri: str, name: str, digest: str | None = None) -> str:
    """Upload the checkpoint version at `local` (a checkpoint link is followed once, and that version is held
    against deletion by a newer save meanwhile) to `<base_uri>/<name>/<sha256>`, manifest last; return that URI
    (models/checkpoint_store.py). `digest`, if given, is what the caller recorded for it (save_checkpoint's
    sha256): a version whose files hash otherwise is refused rather than published under the wrong name."""
    root = Path(local).resolve()
    with _reading(root) as pinned:
        if not pinned:
            raise FileNotFoundError(f"checkpoint {local}: its version {root.name} is gone (replaced by a newer "
                                    "save); nothing published")
        return upload_checkpoint(root, base_uri, name, digest, shown=local)


def recorded_uri(info: CheckpointInfo, name: str) -> str:
    """What to record as the checkpoint's location: its URI on the store when FACTORY_CHECKPOINT_URI is set (published
    there as `<store>/<name>/<sha256>`), else its local path."""
    store = checkpoint_store_uri()
    if store is None:
        return str(info.path)
    return publish_checkpoint(info.path, store, name, info.sha256)


def read_meta(path: str | Path) -> dict[str, Any]:
    f = Path(path) / META_FILE
    return json.loads(f.read_text()) if f.is_file() else {}


def remove_checkpoint(path: str | Path) -> None:
    """Delete the checkpoint at `path`: the link and the version it points at (or a plain directory), and
    what killed saves of it left. (shutil.rmtree refuses a symlink, and unlinking one leaves its version.)"""
    path = Path(path)
    if not path.parent.is_dir():
        return
    with file_lock(path.with_name(f".{path.name}.lock")):
        version = _version_of(path)
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        if version is not None:
            _delete_version(version)
        _remove_leftovers(path)
    # The empty lock file stays: deleting it would let a saver waiting on it and a new one run at once.


# ---------------------------------------------------------------- the swap


def _switch(path: Path, new: Path) -> None:
    """Point `path` at version directory `new` in one atomic step, then delete what it pointed at before."""
    old_version = _version_of(path)
    link = path.with_name(f".{path.name}.{_LINK_TAG}{new.name.rsplit(VERSION_TAG, 1)[1]}")
    os.symlink(new.name, link)
    if path.is_dir() and not path.is_symlink():
        try:
            _exchange(link, path)  # now `path` is the link, and the old directory is at the link's temp name
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            aside = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.rename(path, aside)  # no RENAME_EXCHANGE here: `path` is missing until the next line
            os.replace(link, path)
            link = aside
        _delete_version(link)
    else:
        os.replace(link, path)  # replaces the old link (or a file), or creates `path`
    _fsync_dir(path.parent)
    if old_version is not None and old_version != new:
        _delete_version(old_version)


@contextlib.contextmanager
def _reading(version: Path) -> Iterator[bool]:
    """Hold a shared flock on directory `version` for the block: no save deletes it meanwhile. Yields False
    if it is gone or a save is deleting it (the caller looks up the current version again)."""
    try:
        fd = os.open(version, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError:
            pass  # a filesystem without flock on directories: load_checkpoint's retry covers a deletion
        yield True
    finally:
        os.close(fd)


def _delete_version(version: Path) -> None:
    """Delete a version directory unless a reader holds it (then a later save's leftover sweep deletes it)."""
    try:
        fd = os.open(version, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return
        except OSError:
            pass
        shutil.rmtree(version, ignore_errors=True)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> None:
    """Swap the names `a` and `b` atomically (Linux renameat2 RENAME_EXCHANGE); OSError(ENOSYS) elsewhere."""
    fn = getattr(_libc(), "renameat2", None) if sys.platform.startswith("linux") else None
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _version_of(path: Path) -> Path | None:
    """The version directory that the link `path` points at, if it is one of ours (a sibling .<name>.v-*)."""
    if not path.is_symlink():
        return None
    target = os.readlink(path)
    if "/" in target or not target.startswith(f".{path.name}.{VERSION_TAG}"):
        return None
    return path.with_name(target)


def _remove_leftovers(path: Path) -> None:
    """Delete what saves of `path` that died midway left: versions it does not point at, temp links, and
    the old directories of older Factory versions; not a version a reader still holds. Only called with
    `path`'s lock held."""
    current = _version_of(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.{_LEFTOVER}")
    for p in path.parent.iterdir():
        if p == current or not pattern.fullmatch(p.name):
            continue
        if p.is_symlink() or p.is_file():
            p.unlink(missing_ok=True)
        else:
            _delete_version(p)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*"), reverse=True):  # files before the directories that name them
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            _fsync_dir(p)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
