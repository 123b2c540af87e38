"""FACTORY_HOME: the one directory that holds all state (catalog, warehouse, MLflow, checkpoints, Dagster),
and the file lock that serializes first-time set-up of its stores across processes."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = ".factory"


@dataclass(frozen=True)
class FactoryPaths:
    root: Path

    @property
    def catalog_db(self) -> Path:
        return self.root / "lake" / "catalog.db"

    @property
    def warehouse(self) -> Path:
        return self.root / "lake" / "warehouse"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow" / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlflow" / "artifacts"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def checkpoint_cache(self) -> Path:
        """Local copies of checkpoints fetched from an object store, one directory per sha256 (created on use)."""
        return self.root / "cache" / "checkpoints"

    @property
    def datasets(self) -> Path:
        return self.root / "datasets"

    @property
    def dagster_home(self) -> Path:
        return self.root / "dagster"

    def ensure(self) -> FactoryPaths:
        for d in (self.catalog_db.parent, self.warehouse, self.mlflow_db.parent, self.mlflow_artifacts,
                  self.checkpoints, self.datasets, self.dagster_home):
            d.mkdir(parents=True, exist_ok=True)
        return self


def factory_home(root: str | Path | None = None) -> FactoryPaths:
    """Paths under `root`, else $FACTORY_HOME, else ./.factory; absolute, directories created."""
    root = root or os.environ.get("FACTORY_HOME") or DEFAULT_HOME
    return FactoryPaths(Path(root).expanduser().resolve()).ensure()


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the block: serializes processes and threads
    that set up one store at once (two `factory run`s, a run beside the Dagster UI, sweep members on a fresh
    home). The kernel drops the lock when its holder dies, so a killed holder never leaves it stuck."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
