"""The Iceberg catalog: open it (SQLite SqlCatalog under FACTORY_HOME by default) and create the tables."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from pathlib import Path

from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import (
    CommitFailedException,
    NamespaceAlreadyExistsError,
    NoSuchTableError,
    TableAlreadyExistsError,
)
from pyiceberg.table import Table
from sqlalchemy.exc import OperationalError

from factory.home import FactoryPaths, factory_home
from factory.lake.schemas import NAMESPACE, TABLES, TableDef

log = logging.getLogger(__name__)

CATALOG_NAME = "factory"

# Every write is a commit, so a long run makes thousands of snapshots: keep only the last metadata
# files on disk, and merge manifests so planning a scan does not open one manifest per commit.
# The retry settings make concurrent writers (trainer, evaluator, Dagster) back off briefly and retry
# instead of failing after pyiceberg's default 4 attempts.
TABLE_PROPERTIES: dict[str, str] = {
    "write.metadata.delete-after-commit.enabled": "true",
    "write.metadata.previous-versions-max": "20",
    "commit.manifest-merge.enabled": "true",
    "commit.manifest.min-count-to-merge": "16",
    "commit.retry.num-retries": "10",
    "commit.retry.min-wait-ms": "20",
    "commit.retry.max-wait-ms": "2000",
}
# Full (untruncated) min/max stats for the string key columns: run ids are longer than the default
# 16-character truncation, and exact bounds let a keyed delete skip files of other runs and keep
# concurrent writers of different runs from looking like conflicts.
TABLE_PROPERTIES.update({
    f"write.metadata.metrics.column.{col}": "full"
    for col in ("run_id", "prompt_id", "benchmark", "metric", "node", "check")
})


def open_catalog(paths: FactoryPaths | None = None, uri: str | None = None, **props: str) -> Catalog:
    """Open the lake's catalog.

    With no `props`: a SqlCatalog at `uri` (default: SQLite at paths.catalog_db) whose warehouse is
    paths.warehouse. With `props`: any pyiceberg catalog, `load_catalog(name, uri=uri, **props)`
    (e.g. type="rest", uri="https://..."); `name` defaults to "factory" and ~/.pyiceberg.yaml applies.
    """
    if props:
        name = props.pop("name", CATALOG_NAME)
        if uri is not None:
            props["uri"] = uri
        return load_catalog(name, **props)
    paths = paths or factory_home()
    if uri is None:
        _use_wal(paths.catalog_db)
        uri = f"sqlite:///{paths.catalog_db}"
    warehouse = paths.warehouse.as_uri()
    try:
        return SqlCatalog(CATALOG_NAME, uri=uri, warehouse=warehouse)
    except OperationalError:
        # Two processes creating the catalog's own SQL tables at once: one loses the
        # CREATE TABLE race; by now the tables exist, so a second open succeeds.
        return SqlCatalog(CATALOG_NAME, uri=uri, warehouse=warehouse)


def _use_wal(db: Path) -> None:
    """Put the SQLite catalog in WAL mode (a persistent property of the file): readers no longer block
    the committing writer, and a commit costs one WAL append instead of a rollback journal dance."""
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")


def ensure_tables(catalog: Catalog) -> dict[str, Table]:
    """Create namespace `factory` and every table in TABLES if missing; bring older tables up to date
    (TABLE_PROPERTIES, columns appended to a schema since). Idempotent and safe when processes race."""
    try:
        catalog.create_namespace(NAMESPACE)
    except NamespaceAlreadyExistsError:
        pass
    return {name: _ensure_table(catalog, tdef) for name, tdef in TABLES.items()}


def _ensure_table(catalog: Catalog, tdef: TableDef) -> Table:
    # Look first: a create that loses to an existing table has already written a metadata file.
    try:
        table = catalog.load_table(tdef.identifier)
    except NoSuchTableError:
        try:
            return catalog.create_table(tdef.identifier, schema=tdef.schema,
                                        properties={"format-version": "2", **TABLE_PROPERTIES})
        except TableAlreadyExistsError:  # another process created it in between
            table = catalog.load_table(tdef.identifier)
    stale = {k: v for k, v in TABLE_PROPERTIES.items() if table.properties.get(k) != v}
    if stale:
        try:
            with table.transaction() as tx:
                tx.set_properties(stale)
        except CommitFailedException:
            pass  # another process updated it first
        table = catalog.load_table(tdef.identifier)
    missing = [c for c in tdef.columns if c not in {f.name for f in table.schema().fields}]
    if missing:
        log.info("lake: adding columns %s to %s", missing, tdef.name)
        try:
            with table.update_schema() as update:
                update.union_by_name(tdef.schema)
        except CommitFailedException:
            pass  # another process evolved it first; reload below
        table = catalog.load_table(tdef.identifier)
    return table
