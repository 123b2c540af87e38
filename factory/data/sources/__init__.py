"""Prompt sources, one module per concern:

- base: the `PromptSource` interface, `ListSource` (rows in memory), `num_blocks`
- rows: building `Problem` rows from Arrow columns, verifier names
- generated: an arithmetic level generated from a seed; the shipped suites (word problems, code)
- field: the field's task libraries: a reasoning-gym dataset, HumanEval
- files: JSONL, Parquet, and Hugging Face `save_to_disk` directories, read in blocks without loading them
- iceberg: an Iceberg table pinned to a snapshot
- kinds: `make_source(spec)`, the source class of each kind of spec (the specs: factory/source_spec.py)

A source object is not thread-safe (Parquet and Iceberg sources keep a read cursor so that sequential blocks
continue one decode stream): open one per thread or process.
"""

from factory.data.sources.field import HumanEvalSource, ReasoningGymSource
from factory.data.sources.files import HFDiskSource, JsonlSource, ParquetSource
from factory.data.sources.generated import ArithmeticSource, SuiteSource
from factory.data.sources.iceberg import IcebergSource
from factory.data.sources.kinds import make_source
from factory.data.sources.rows import check_verifier

__all__ = [
    "ArithmeticSource", "SuiteSource", "JsonlSource", "ParquetSource", "HFDiskSource", "IcebergSource",
    "ReasoningGymSource", "HumanEvalSource", "check_verifier", "make_source",
]
