"""Specs in: `parse_spec` (a mapping), `load_spec` (a YAML file, its file sources' relative paths anchored at its
folder), `--set` overrides parsed and applied."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from factory.config.errors import SpecError, _describe
from factory.config.experiment import ExperimentSpec
from factory.config.yaml_io import DuplicateKeyError, YAMLBombError, load_yaml


def parse_spec(data: Any, source: str | None = None) -> ExperimentSpec:
    """Validate a mapping as an ExperimentSpec; raise SpecError naming every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"<spec>: expected a mapping of sections, got {type(data).__name__}"], source)
    try:
        return ExperimentSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError([_describe(err) for err in e.errors(include_url=False)], source) from None


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read a YAML spec file; errors name the file and the field path."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([f"<file>: no such spec file: {path}"], str(path))
    try:
        data = load_yaml(path.read_text())
    except (DuplicateKeyError, YAMLBombError) as e:
        raise SpecError([f"<file>: {e}"], str(path)) from None
    except yaml.YAMLError as e:
        raise SpecError([f"<file>: not valid YAML: {e}"], str(path)) from None
    anchor_source_paths(data, path.parent)
    return parse_spec(data, str(path))


FILE_SOURCE_KINDS = ("jsonl", "parquet", "hf_disk")


def anchor_source_paths(data: Any, folder: str | Path) -> None:
    """Make each relative `path:` of the file sources in raw spec `data` absolute under `folder` (the spec file's
    folder), in place, so a spec means the same files wherever the command runs (and in a run's own copy of it).
    A spec built in Python keeps its paths as given: relative ones are then relative to the working directory of
    the process that opens the sources. Malformed entries are left for validation to report."""
    sources = data.get("data", {}).get("sources") if isinstance(data, dict) and isinstance(data.get("data"), dict) \
        else None
    if not isinstance(sources, list):
        return
    for s in sources:
        if isinstance(s, dict) and s.get("kind") in FILE_SOURCE_KINDS and isinstance(s.get("path"), str) \
                and s["path"]:
            p = os.path.expanduser(s["path"])
            if not os.path.isabs(p):
                s["path"] = os.path.normpath(os.path.join(os.path.abspath(folder), p))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["algorithm.lr=1e-4", "task.digits=[2,3]"]` → `{"algorithm.lr": 0.0001, ...}` (values are YAML)."""
    pairs: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError([f"{item}: expected path=value, e.g. algorithm.lr=1e-4"])
        try:
            pairs[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise SpecError([f"{key.strip()}: value {value!r} is not valid YAML: {e}"]) from None
    return pairs


def apply_overrides(spec: ExperimentSpec, overrides: dict[str, Any]) -> ExperimentSpec:
    """Return a copy with dotted-path overrides applied (`{"algorithm.lr": 1e-4}`), re-validated."""
    data = spec.model_dump(mode="json")
    if "preset" not in spec.model.model_fields_set:  # a preset left to its default stays implicit (see ignored_preset)
        data["model"].pop("preset", None)
    for dotted, value in overrides.items():
        node: Any = data
        parts = dotted.split(".")
        for i, p in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):  # a list entry by index, e.g. data.sources.1.n
                if not p.isdigit() or int(p) >= len(node):
                    raise SpecError([f"{dotted}: {p!r} is not an index of the {len(node)} entries of "
                                     f"{'.'.join(parts[:i])}"])
                if last:
                    node[int(p)] = value
                else:
                    node = node[int(p)]
                continue
            if not isinstance(node, dict):
                raise SpecError([f"{dotted}: {parts[i - 1]!r} is a value, not a section"])
            if last:
                node[p] = value
            else:
                # An unknown section is created so validation names it as an unknown key.
                node = node.setdefault(p, {})
    return parse_spec(data)
