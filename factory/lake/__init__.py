"""The lake: Iceberg tables (namespace `factory`) that are the system of record of every run.

- schemas: the tables, their columns and keys (`TABLES`)
- catalog: opening the catalog, creating tables
- writer: `Lake` — idempotent keyed upserts, reads, small-file upkeep
- query: SQL over the tables with DuckDB, and output formats
- history: run history over the tables: rank runs by a final eval (`best`), compare two runs
"""

from factory.lake.catalog import ensure_tables, open_catalog
from factory.lake.query import QueryError, format_table, query
from factory.lake.schemas import NAMESPACE, TABLES, TableDef, to_arrow_schema
from factory.lake.writer import Lake

__all__ = [
    "NAMESPACE", "TABLES", "TableDef", "to_arrow_schema", "open_catalog", "ensure_tables", "Lake",
    "query", "format_table", "QueryError",
]
