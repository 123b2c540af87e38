"""`make_source`: the source class that opens each kind of source spec (factory/source_spec.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from factory.data.sources.base import PromptSource
from factory.lake.catalog import open_catalog
from factory.source_spec import (
    ArithmeticSourceSpec,
    HFDiskSourceSpec,
    HumanEvalSourceSpec,
    IcebergSourceSpec,
    JsonlSourceSpec,
    ReasoningGymSourceSpec,
    SuiteSourceSpec,
    parse_source_spec,
)

from .field import HumanEvalSource, ReasoningGymSource
from .files import HFDiskSource, JsonlSource, ParquetSource
from .generated import ArithmeticSource, SuiteSource
from .iceberg import IcebergSource


def make_source(spec: dict[str, Any] | BaseModel, *, base_dir: str | Path | None = None,
                catalog: Any = None) -> PromptSource:
    """Open the source `spec` describes. Relative paths are under `base_dir` (e.g. the spec file's folder);
    an Iceberg source reads `catalog` (a pyiceberg Catalog or a `Lake`; default: the lake of $FACTORY_HOME)."""
    s = parse_source_spec(spec)
    if isinstance(s, ArithmeticSourceSpec):
        return ArithmeticSource(s.name, s.op, s.digits, s.n, seed=s.seed, start=s.start,
                                reverse_answer=s.reverse_answer, reverse_operands=s.reverse_operands,
                                block_rows=s.block_rows, verifier=s.verifier)
    if isinstance(s, ReasoningGymSourceSpec):
        return ReasoningGymSource(s.name, s.task, s.config, seed=s.seed, size=s.size, block_rows=s.block_rows,
                                  verifier=s.verifier, instruction=s.instruction)
    if isinstance(s, HumanEvalSourceSpec):
        return HumanEvalSource(s.name, size=s.size, block_rows=s.block_rows)
    if isinstance(s, SuiteSourceSpec):
        return SuiteSource(s.name, s.suite, block_rows=s.block_rows)
    if isinstance(s, IcebergSourceSpec):
        catalog = getattr(catalog, "catalog", catalog)  # a Lake or its catalog
        if catalog is None:
            catalog = open_catalog()
        return IcebergSource(s.name, catalog, s.table, s.verifier, snapshot_id=s.snapshot_id, columns=s.columns,
                             block_rows=s.block_rows)
    path = Path(s.path)
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path
    if isinstance(s, HFDiskSourceSpec):
        return HFDiskSource(s.name, path, s.verifier, s.columns, split=s.split, block_rows=s.block_rows)
    cls = JsonlSource if isinstance(s, JsonlSourceSpec) else ParquetSource
    return cls(s.name, path, s.verifier, s.columns, block_rows=s.block_rows)
