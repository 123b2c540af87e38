"""The spec of one prompt source (an entry of a `data` section) and `make_source`, which opens it.

One pydantic model per kind, told apart by `kind`; `make_source` accepts the model or its dict. In YAML:

    - {name: add3, kind: arithmetic, op: add, digits: 3, n: 200000, seed: 0}
    - {name: wp, kind: suite, suite: word_problems}
    - name: gsm
      kind: parquet                      # or jsonl, hf_disk (+ split)
      path: data/gsm/                    # a file, or a directory of .parquet shards
      verifier: word_problems            # a task family, a built-in environment, or pkg.module:attr
      columns: {id: qid, prompt: question, answer: final, meta: [topic]}
    - {name: mined, kind: iceberg, table: factory_data.prompts, snapshot_id: 4829917301, verifier: code,
       columns: {prompt: prompt, answer: solution, meta: [tests]}}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from factory.data.source import PromptSource

from .rows import ColumnMap, SourceError

_NAME = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="the source's name (in records and weights)")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = _NAME
    block_rows: int = Field(1024, ge=1, description="rows per block: the unit of reading and of block shuffling")


class ArithmeticSourceSpec(_Spec):
    kind: Literal["arithmetic"]
    op: Literal["add", "sub", "mul"]
    digits: int = Field(ge=1, le=18)
    n: int = Field(ge=1, description="rows: distinct problems of this level")
    seed: int = 0
    start: int = Field(0, ge=0, description="first problem of the seeded order (a held-out set takes another range)")
    reverse_answer: bool = True
    reverse_operands: bool = False
    verifier: str = "arithmetic"


class SuiteSourceSpec(_Spec):
    kind: Literal["suite"]
    suite: Literal["word_problems", "code"]
    block_rows: int = Field(128, ge=1)


class _FileSpec(_Spec):
    path: str
    verifier: str = Field(description="what scores the rows: a task family, a built-in environment or an import path")
    columns: ColumnMap = ColumnMap()


class JsonlSourceSpec(_FileSpec):
    kind: Literal["jsonl"]


class ParquetSourceSpec(_FileSpec):
    kind: Literal["parquet"]


class HFDiskSourceSpec(_FileSpec):
    kind: Literal["hf_disk"]
    split: str | None = Field(None, description="the split of a DatasetDict directory")


class IcebergSourceSpec(_Spec):
    kind: Literal["iceberg"]
    table: str = Field(description="namespace.table in the lake's catalog")
    snapshot_id: int | None = Field(None, description="the pinned snapshot (default: the current one when opened)")
    verifier: str
    columns: ColumnMap = ColumnMap()


SourceSpec = Annotated[
    ArithmeticSourceSpec | SuiteSourceSpec | JsonlSourceSpec | ParquetSourceSpec | HFDiskSourceSpec
    | IcebergSourceSpec,
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(SourceSpec)


def parse_source_spec(spec: dict[str, Any] | BaseModel) -> Any:
    """The typed spec of a source dict; SourceError naming the source and the bad field."""
    if isinstance(spec, BaseModel):
        return spec
    try:
        return _ADAPTER.validate_python(spec)
    except ValidationError as e:
        name = spec.get("name", "?") if isinstance(spec, dict) else "?"
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in e.errors())
        raise SourceError(f"source {name!r}: {problems}") from e


def make_source(spec: dict[str, Any] | BaseModel, *, base_dir: str | Path | None = None,
                catalog: Any = None) -> PromptSource:
    """Open the source `spec` describes. Relative paths are under `base_dir` (e.g. the spec file's folder);
    an Iceberg source reads `catalog` (a pyiceberg Catalog or a `Lake`; default: the lake of $FACTORY_HOME)."""
    from .files import HFDiskSource, JsonlSource, ParquetSource
    from .generated import ArithmeticSource, SuiteSource
    from .iceberg import IcebergSource

    s = parse_source_spec(spec)
    if isinstance(s, ArithmeticSourceSpec):
        return ArithmeticSource(s.name, s.op, s.digits, s.n, seed=s.seed, start=s.start,
                                reverse_answer=s.reverse_answer, reverse_operands=s.reverse_operands,
                                block_rows=s.block_rows, verifier=s.verifier)
    if isinstance(s, SuiteSourceSpec):
        return SuiteSource(s.name, s.suite, block_rows=s.block_rows)
    if isinstance(s, IcebergSourceSpec):
        catalog = getattr(catalog, "catalog", catalog)  # a Lake or its catalog
        if catalog is None:
            from factory.lake import open_catalog

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
