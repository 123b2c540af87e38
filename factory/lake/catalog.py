"""The Iceberg catalog: open it (SQLite SqlCatalog under FACTORY_HOME by default) and create the tables.

Settings: FACTORY_CATALOG_URI picks the catalog (a SQLAlchemy URI: a SqlCatalog on that database, e.g. a team's
Postgres; `http(s)://`: an Iceberg REST catalog such as Lakekeeper, Polaris or Nessie, with FACTORY_CATALOG_WAREHOUSE,
FACTORY_CATALOG_TOKEN or FACTORY_CATALOG_CREDENTIAL passed on). FACTORY_WAREHOUSE_URI (`s3://bucket/prefix`,
`gs://...`) puts a SQL catalog's warehouse, the tables' data and metadata files, on an object store, reached with
pyarrow's FileIO and the AWS_* settings (factory/objstore.py); a REST catalog's server decides where its tables live.

A SqlCatalog's pooled connections are checked before each use (SQLAlchemy's pool_pre_ping, which pyiceberg's
SqlCatalog takes as its `pool_pre_ping` property): after a catalog server restarts, every pooled connection is
dead, and without the check the first read after it fails (an OperationalError) although the server is back.

Opening a fresh SQLite catalog and creating its namespace and tables are serialized across processes with
an flock beside catalog.db: pyiceberg's create_namespace reports a lost race as an IntegrityError, not
NamespaceAlreadyExistsError, and a create_table that loses leaves an orphan metadata file."""

from __future__ import annotations

import contextlib
import logging
import os
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
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, OperationalError

from factory.home import FactoryPaths, factory_home, file_lock
from factory.lake.rest import REST_SCHEMES, open_rest_catalog
from factory.lake.schemas import NAMESPACE, TABLES, TableDef
from factory.objstore import check_uri, iceberg_io_properties

log = logging.getLogger(__name__)

CATALOG_NAME = "factory"
CATALOG_URI_ENV = "FACTORY_CATALOG_URI"  # a SQL catalog server (Postgres) or a REST catalog instead of the SQLite file
WAREHOUSE_URI_ENV = "FACTORY_WAREHOUSE_URI"  # an object-store warehouse instead of FACTORY_HOME/lake/warehouse

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

    With no `props`: the catalog at `uri` (default: $FACTORY_CATALOG_URI, else SQLite at paths.catalog_db):
    `http(s)://...` is an Iceberg REST catalog (factory/lake/rest.py); anything else is a SQLAlchemy URI for a
    SqlCatalog, e.g. `postgresql+psycopg2://user:pw@host/db` for a team's Postgres, whose warehouse is
    $FACTORY_WAREHOUSE_URI if set (s3://, gs://), else paths.warehouse. With `props`: any pyiceberg catalog,
    `load_catalog(name, uri=uri, **props)` (e.g. type="rest", uri="https://..."); `name` defaults to "factory"
    and ~/.pyiceberg.yaml applies.
    """
    if props:
        name = props.pop("name", CATALOG_NAME)
        if uri is not None:
            props["uri"] = uri
        return load_catalog(name, **props)
    paths = paths or factory_home()
    uri = uri or os.environ.get(CATALOG_URI_ENV) or None
    if uri is not None and uri.split("://", 1)[0].lower() in REST_SCHEMES:
        return open_rest_catalog(CATALOG_NAME, uri, setting=CATALOG_URI_ENV)
    default = uri is None
    uri = uri or f"sqlite:///{paths.catalog_db}"
    warehouse_uri = os.environ.get(WAREHOUSE_URI_ENV) or None
    if warehouse_uri is not None:
        warehouse, io_props = check_uri(warehouse_uri, WAREHOUSE_URI_ENV), iceberg_io_properties()
    else:
        warehouse, io_props = paths.warehouse.as_uri(), {}
    props = {"warehouse": warehouse, "pool_pre_ping": "true", **io_props}
    with _setup_lock(uri):
        if default:
            _use_wal(paths.catalog_db)
        try:
            return SqlCatalog(CATALOG_NAME, uri=uri, **props)
        except OperationalError:
            # A process of an older Factory (no lock) created the catalog's own SQL tables at the same
            # time; by now they exist, so a second open succeeds.
            return SqlCatalog(CATALOG_NAME, uri=uri, **props)


def _setup_lock(uri: str | None) -> contextlib.AbstractContextManager[object]:
    """An flock beside a local SQLite catalog file (`<file>.lock`); no lock for other catalogs (a REST or SQL
    server catalog is shared by design and handles its own concurrency)."""
    url = make_url(uri) if uri else None
    if url is not None and url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        db = Path(url.database)
        return file_lock(db.with_name(db.name + ".lock"))
    return contextlib.nullcontext()


def _use_wal(db: Path) -> None:
    """Put the SQLite catalog in WAL mode (a persistent property of the file): readers no longer block
    the committing writer, and a commit costs one WAL append instead of a rollback journal dance."""
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")


def ensure_tables(catalog: Catalog) -> dict[str, Table]:
    """Create namespace `factory` and every table in TABLES if missing; bring older tables up to date
    (TABLE_PROPERTIES, columns appended to a schema since, partitioning). Idempotent and safe when
    processes race (a local SQLite catalog is set up by one process at a time). Never rewrites data: a
    schema or spec change is a metadata-only commit."""
    engine = getattr(catalog, "engine", None)  # SqlCatalog's SQLAlchemy engine
    with _setup_lock(engine.url.render_as_string(hide_password=False) if engine is not None else None):
        try:
            catalog.create_namespace(NAMESPACE)
        except NamespaceAlreadyExistsError:
            pass
        except IntegrityError:  # a server catalog (no setup lock): another process created it in between
            pass
        return {name: _ensure_table(catalog, tdef) for name, tdef in TABLES.items()}


def _ensure_table(catalog: Catalog, tdef: TableDef) -> Table:
    table = _load_or_create(catalog, tdef)
    table = _update_properties(catalog, tdef, table)
    table = _add_columns(catalog, tdef, table)
    table = _update_partitioning(catalog, tdef, table)
    _check_field_ids(tdef, table)
    return table


def _load_or_create(catalog: Catalog, tdef: TableDef) -> Table:
    # Look first: a create that loses to an existing table has already written a metadata file.
    try:
        return catalog.load_table(tdef.identifier)
    except NoSuchTableError:
        pass
    try:
        return catalog.create_table(tdef.identifier, schema=tdef.schema, partition_spec=tdef.partition_spec(),
                                    properties={"format-version": "2", **TABLE_PROPERTIES})
    except TableAlreadyExistsError:  # another process created it in between
        return catalog.load_table(tdef.identifier)


def _update_properties(catalog: Catalog, tdef: TableDef, table: Table) -> Table:
    stale = {k: v for k, v in TABLE_PROPERTIES.items() if table.properties.get(k) != v}
    if not stale:
        return table
    try:
        with table.transaction() as tx:
            tx.set_properties(stale)
    except CommitFailedException:
        pass  # another process updated it first
    return catalog.load_table(tdef.identifier)


def _add_columns(catalog: Catalog, tdef: TableDef, table: Table) -> Table:
    """Add the columns appended to `tdef` since the table was created. Only optional ones: rows
    already written have no value for them (they read back as null)."""
    present = {f.name for f in table.schema().fields}
    missing = [f for f in tdef.schema.fields if f.name not in present]
    if not missing:
        return table
    required = [f.name for f in missing if f.required]
    if required:
        raise ValueError(f"lake table {tdef.name}: cannot add required column(s) {required} to an existing "
                         "table (its rows have no value for them); declare new columns optional")
    log.info("lake: adding columns %s to %s", [f.name for f in missing], tdef.name)
    try:
        with table.update_schema() as update:
            for f in missing:  # in definition order, so they get the next field ids, as in the definition
                update.add_column(f.name, f.field_type, doc=f.doc)
    except CommitFailedException:
        pass  # another process evolved it first; reload below
    return catalog.load_table(tdef.identifier)


def _update_partitioning(catalog: Catalog, tdef: TableDef, table: Table) -> Table:
    """Evolve the table's partition spec to `tdef.partition`. Metadata only: files already written
    keep the spec they were written with (scans and keyed deletes handle both); new files use the new one."""
    schema = table.schema()
    have = {(schema.find_column_name(f.source_id), str(f.transform)): f.name for f in table.spec().fields}
    want = {(p.column, str(p.transform)): p for p in tdef.partition}
    if have.keys() == want.keys():
        return table
    log.info("lake: partitioning %s by %s", tdef.name, [p.name for p in tdef.partition] or "nothing")
    try:
        with table.update_spec() as update:
            for k, name in have.items():
                if k not in want:
                    update.remove_field(name)
            for k, p in want.items():
                if k not in have:
                    update.add_field(p.column, p.transform, p.name)
    except CommitFailedException:
        pass  # another process evolved it first; reload below
    return catalog.load_table(tdef.identifier)


def _check_field_ids(tdef: TableDef, table: Table) -> None:
    # Writes carry the definition's field ids in their Arrow schema and pyiceberg matches columns by
    # id, so a table whose ids differ would get values in the wrong columns: refuse it loudly.
    schema = table.schema()
    for f in tdef.schema.fields:
        got = schema.find_field(f.name).field_id
        if got != f.field_id:
            raise ValueError(f"lake table {tdef.name}: column {f.name!r} has field id {got} in the catalog, "
                             f"expected {f.field_id} (columns must only be appended to a TableDef)")
