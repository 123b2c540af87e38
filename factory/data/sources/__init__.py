"""Prompt sources (the `PromptSource` interface of factory/data/source.py), one module per concern:

- rows: the column mapping, building `Problem` rows from Arrow columns, verifier names, `SourceError`
- generated: an arithmetic level generated from a seed; the shipped suites (word problems, code)
- files: JSONL, Parquet, and Hugging Face `save_to_disk` directories, read in blocks without loading them
- iceberg: an Iceberg table pinned to a snapshot
- spec: one pydantic spec per kind and `make_source(spec)`

A source object is not thread-safe (Parquet and Iceberg sources keep a read cursor so that sequential blocks
continue one decode stream): open one per thread or process.
"""

from factory.data.sources.files import HFDiskSource, JsonlSource, ParquetSource
from factory.data.sources.generated import ArithmeticSource, SuiteSource
from factory.data.sources.iceberg import IcebergSource
from factory.data.sources.rows import ColumnMap, SourceError, check_verifier
from factory.data.sources.spec import SourceSpec, make_source, parse_source_spec

__all__ = [
    "ArithmeticSource", "SuiteSource", "JsonlSource", "ParquetSource", "HFDiskSource", "IcebergSource",
    "ColumnMap", "SourceError", "check_verifier", "SourceSpec", "make_source", "parse_source_spec",
]
