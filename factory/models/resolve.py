"""`model.path` in its three forms (a directory, a `.gguf` file, a cached Hugging Face Hub id; which is which:
factory/model_source.py), resolved to the Hugging Face directory every loader reads.

`resolve_model_path` is what training, the rank followers and `factory models import` call (a GGUF file is
converted here, once, into a content-addressed directory under FACTORY_HOME and reused; a hub id is its cached
snapshot); `check_model_path` is `factory validate`'s cheap check (nothing converted, no weights read);
`model_provenance` is what a run records about where its model came from.
"""

from __future__ import annotations

from pathlib import Path

from factory.home import FactoryPaths
from factory.model_source import hub_snapshot, model_source
from factory.models.gguf import check_gguf_file, convert_gguf, converted_dir
from factory.models.hf import check_model_dir
from factory.progress import Log


def resolve_model_path(value: str | Path, home: FactoryPaths, log: Log = print) -> Path:
    """The HF directory `value` names: the directory itself, the GGUF file's conversion under `home` (converted
    now if it was not before), or the hub id's cached snapshot. Errors name model.path and what was expected."""
    src = model_source(value)
    if src.kind == "gguf":
        return check_model_dir(convert_gguf(src.value, home, log=log))
    if src.kind == "hub":
        return check_model_dir(hub_snapshot(src.value))
    return check_model_dir(src.value)


def check_model_path(value: str | Path, home: FactoryPaths) -> str:
    """A one-line description of what `value` resolves to, checked without converting or loading weights (the
    GGUF file's magic bytes, the hub snapshot's or directory's config and tokenizer files); the error else."""
    src = model_source(value)
    if src.kind == "gguf":
        done = converted_dir(check_gguf_file(src.value), home)
        return (f"model.path: GGUF file {src.value}, converted in {done}" if done is not None else
                f"model.path: GGUF file {src.value}, to be converted once under {home.root / 'models' / 'gguf'}")
    if src.kind == "hub":
        return f"model.path: Hugging Face model {src.value}, cached in {check_model_dir(hub_snapshot(src.value))}"
    return f"model.path: model directory {check_model_dir(src.value)}"


def model_provenance(value: str | Path, resolved: Path) -> dict[str, str]:
    """What a run records about its model: `model.path` as given, its form, and the directory it loaded."""
    return {"path": str(value), "kind": model_source(value).kind, "dir": str(Path(resolved).resolve())}
