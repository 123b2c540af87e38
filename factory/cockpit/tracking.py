"""MLflow mirror of runs: params, step metrics, tags and artifacts, for curves in the MLflow UI.

Iceberg is the system of record; MLflow is a view. `Tracker` wraps `mlflow.MlflowClient` on a SQLite
backend under FACTORY_HOME (MLflow 3 refuses the plain file store) and never touches MLflow's global
"active run" state, so one process can drive many runs at once (a sweep, a Dagster worker).

First-time set-up of the SQLite store is a multi-step Alembic migration that is not safe to run twice at
once (processes racing on a fresh home failed with `table trace_info already exists` and left a half-made
mlflow.db that failed every later run). `ensure_sqlite_store` builds the store once, under an flock beside
mlflow.db, in a temp file renamed into place, so mlflow.db is either absent or complete.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import sqlite3
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from mlflow.utils.validation import (
    MAX_ENTITY_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from factory.home import FactoryPaths, factory_home, file_lock
from factory.text import clip

log = logging.getLogger(__name__)

RunStatus = Literal["FINISHED", "FAILED", "KILLED"]
DEFAULT_UI_URL = "http://127.0.0.1:5000"  # where `make ui` serves the MLflow UI


# MLflow 3's UI opens in its GenAI view (traces, sessions) unless told otherwise: the page's `workflowType` query
# parameter picks the view (it falls back to the browser's last choice, GenAI on a fresh browser), and an
# experiment's `mlflow.experimentKind` tag says what kind of work it holds. Factory's runs are model training, so
# links carry the one and experiments get the other (read from MLflow 3.17's UI bundle, mlflow/server/js).
WORKFLOW_QUERY = "workflowType=machine_learning"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # shown as "Machine learning" in the UI


def ui_url() -> str:
    """The MLflow UI's address as a browser reaches it ($FACTORY_MLFLOW_UI, default 127.0.0.1:5000): links and
    inline pictures in the Dagster UI point there."""
    return os.environ.get("FACTORY_MLFLOW_UI", DEFAULT_UI_URL).rstrip("/")

# MLflow names may hold word characters and / . - : and space; anything else becomes '_'.
_BAD_NAME_CHARS = re.compile(r"[^\w./\- :]")


@contextlib.contextmanager
def _quiet_db_setup() -> Iterator[None]:
    """Silence MLflow's and Alembic's INFO lines while a fresh SQLite DB is migrated (once per home)."""
    names = ("mlflow.store.db.utils", "mlflow.store.tracking.sqlalchemy_store", "alembic")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


MLFLOW_URI_ENV = "FACTORY_MLFLOW_URI"  # a tracking server or SQL database instead of the SQLite file


class Tracker:
    """MLflow runs under one tracking URI (default: $FACTORY_MLFLOW_URI, e.g. a team's Postgres
    `postgresql://user:pw@host/db` or an MLflow server `http://...`, else sqlite:///{paths.mlflow_db})."""

    def __init__(self, paths: FactoryPaths | None = None, tracking_uri: str | None = None) -> None:
        self.paths = paths or factory_home()
        self.tracking_uri = (tracking_uri or os.environ.get(MLFLOW_URI_ENV)
                             or f"sqlite:///{self.paths.mlflow_db}")
        if self.tracking_uri.startswith("sqlite:///"):
            ensure_sqlite_store(Path(self.tracking_uri.removeprefix("sqlite:///")), self.paths.mlflow_artifacts)
        with _quiet_db_setup():
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            # Touch the store now, so the schema migration (and its log lines) happen here.
            self.client.search_experiments(max_results=1)

    # -- runs -------------------------------------------------------------------------------------

    def start_run(
        self,
        experiment: str,
        run_name: str,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
    ) -> str:
        """Create a run in `experiment` (created if missing), log `params` (nested dicts flattened to
        dotted keys, values str()-ed and cut to MLflow's length limit) and `tags`; return its run id.
        With `parent_run_id` the run is nested under that run (MLflow's `mlflow.parentRunId` tag, which
        the UI uses to fold a sweep's members under the sweep's run)."""
        exp_id = self._experiment_id(experiment)
        all_tags = _tags(tags or {})
        if parent_run_id is not None:
            all_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        run = self.client.create_run(exp_id, run_name=run_name, tags=all_tags)
        run_id = run.info.run_id
        flat = flatten_params(params or {})
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)
        return run_id

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float | None]) -> int:
        """Log `metrics` at `step` in one batch. None values are skipped (a step may lack a metric);
        NaN/inf are kept (a diverging loss is worth seeing); anything float() accepts is taken (numpy and
        0-d torch scalars). Returns how many were logged; TypeError naming the key for other values."""
        now = int(time.time() * 1000)
        items = []
        for k, v in metrics.items():
            if v is None:
                continue
            try:
                value = float(v)
            except (TypeError, ValueError):
                raise TypeError(f"metric {k!r}: {type(v).__name__} is not a number") from None
            items.append(Metric(_name(k), value, now, int(step)))
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=items[i : i + MAX_METRICS_PER_BATCH], synchronous=True)
        return len(items)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        items = [RunTag(k, v) for k, v in _tags(tags).items()]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, tags=items[i : i + MAX_PARAMS_TAGS_PER_BATCH], synchronous=True)

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        """Copy a file or directory into the run's artifacts (under mlflow_artifacts)."""
        self.client.log_artifact(run_id, str(path), artifact_path=artifact_path)

    def log_png(self, run_id: str, artifact_path: str, png: bytes) -> None:
        """Store `png` as the run's artifact at `artifact_path` (e.g. "plots/curves.png"; a directory
        part becomes an artifact folder)."""
        folder, name = posixpath.split(artifact_path.lstrip("/"))
        if not name:
            raise ValueError(f"log_png: artifact_path {artifact_path!r} names no file")
        # MlflowClient logs files from disk only; a private temp dir keeps concurrent calls apart.
        with tempfile.TemporaryDirectory(prefix="factory-png-") as tmp:
            local = Path(tmp) / name
            local.write_bytes(png)
            self.client.log_artifact(run_id, str(local), artifact_path=folder or None)

    def end_run(self, run_id: str, status: RunStatus = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def get_run(self, run_id: str) -> Run:
        return self.client.get_run(run_id)

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI (`ui_url()`), in its machine-learning (training) view."""
        experiment_id = self.client.get_run(run_id).info.experiment_id
        return f"{ui_url()}/#/experiments/{experiment_id}/runs/{run_id}?{WORKFLOW_QUERY}"

    def sweep_url(self, parent_run_id: str, sweep_id: str) -> str:
        """A sweep's members side by side in the MLflow UI: the runs page of the parent's experiment in its chart
        view, filtered to the members (their `factory.sweep_id` tag) and sorted by name. MLflow folds nested runs
        under their parent, collapsed, and charts only the rows shown; it has no tag or setting that opens them
        expanded (it expands only parents of GenAI evaluation runs), but it lists runs flat when they are
        filtered and sorted by anything other than start time, so every member is drawn."""
        experiment_id = self.client.get_run(parent_run_id).info.experiment_id
        query = urllib.parse.urlencode({"searchFilter": f"tags.`factory.sweep_id` = '{sweep_id}'",
                                        "orderByKey": "tags.`mlflow.runName`", "orderByAsc": "true",
                                        "compareRunsMode": "CHART"}, quote_via=urllib.parse.quote)
        return f"{ui_url()}/#/experiments/{experiment_id}/runs?{WORKFLOW_QUERY}&{query}"

    @staticmethod
    def artifact_url(run_id: str, artifact_path: str) -> str:
        """An artifact's bytes as the MLflow UI serves them (an <img> source for a PNG logged with log_png)."""
        query = urllib.parse.urlencode({"path": artifact_path, "run_uuid": run_id})
        return f"{ui_url()}/get-artifact?{query}"

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) pairs of metric `key`, by step (the last value logged wins within a step)."""
        by_step: dict[int, tuple[int, float]] = {}
        for m in self.client.get_metric_history(run_id, _name(key)):
            if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
                by_step[m.step] = (m.timestamp, m.value)
        return [(step, v) for step, (_, v) in sorted(by_step.items())]

    # -- helpers ----------------------------------------------------------------------------------

    def _experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            location = (self.paths.mlflow_artifacts / _dir_name(name)).as_uri()
            try:
                return self.client.create_experiment(name, artifact_location=location,
                                                     tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            except MlflowException:
                # Another process created it between our lookup and create.
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        if EXPERIMENT_KIND_TAG not in exp.tags:  # made by an older Factory, or by hand: say it holds training
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id


# Stores this process has seen complete: later Trackers on them skip the lock and the schema check.
_complete_stores: set[Path] = set()


def ensure_sqlite_store(db: Path, artifact_root: Path) -> None:
    """Make `db` a complete MLflow store (all tables, schema at MLflow's head revision), safely when many
    processes start on one fresh home at once: under an flock on `<db>.lock` the store is built in a temp
    file and renamed into place, so a kill mid-set-up leaves no half-made `db`. A half-made store left by an
    older Factory that holds no runs is moved aside (`<db>.incomplete-<time>`) and built again; one that holds
    runs is left alone and refused (RuntimeError naming the file) rather than touched."""
    db = db.resolve()
    if db in _complete_stores:
        return
    with file_lock(db.with_name(db.name + ".lock")), _quiet_db_setup():
        for stale in db.parent.glob(db.name + ".setup-*"):  # temp stores of set-ups killed midway
            stale.unlink(missing_ok=True)
        state = _store_state(db)
        if state == "incomplete" and not _has_runs(db):
            aside = db.with_name(f"{db.name}.incomplete-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            log.warning("tracking: %s is a half-made MLflow store with no runs (an interrupted first set-up); "
                        "moving it to %s and building it again", db, aside.name)
            os.replace(db, aside)
            state = "missing"
        if state == "missing":
            _build_store(db, artifact_root)
            state = _store_state(db)
        if state != "complete":
            raise RuntimeError(f"MLflow store {db} is incomplete or out of date and holds runs; back it up, then "
                               f"run `mlflow db upgrade sqlite:///{db}` or move it aside to start a new one")
    _complete_stores.add(db)


def _build_store(db: Path, artifact_root: Path) -> None:
    # SqlAlchemyStore runs MLflow's own set-up (tables, every migration, the Default experiment) on the temp
    # file; the rename then publishes a finished store in one step.
    from mlflow.store.tracking.sqlalchemy_store import (  # noqa: PLC0415 heavy: sqlalchemy, alembic; creating only
        SqlAlchemyStore,
    )

    tmp = db.with_name(f"{db.name}.setup-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    store = SqlAlchemyStore(f"sqlite:///{tmp}", artifact_root.as_uri())
    store.engine.dispose()  # close its connections before the file changes name
    os.replace(tmp, db)


def _store_state(db: Path) -> Literal["missing", "complete", "incomplete"]:
    """Whether `db` is absent, a complete MLflow store at MLflow's head schema revision, or anything else."""
    if not db.exists() or db.stat().st_size == 0:
        return "missing"
    # private helpers (mlflow is pinned to one minor version)
    import sqlalchemy  # noqa: PLC0415 heavy: sqlalchemy; only checking the store's schema needs it
    from mlflow.store.db import utils as db_utils  # noqa: PLC0415 heavy: sqlalchemy, alembic; checking the schema only

    engine = sqlalchemy.create_engine(f"sqlite:///{db}", poolclass=sqlalchemy.pool.NullPool)
    try:
        complete = (db_utils._all_tables_exist(engine)
                    and db_utils._get_schema_version(engine) == db_utils._get_latest_schema_revision())
    finally:
        engine.dispose()
    return "complete" if complete else "incomplete"


def _has_runs(db: Path) -> bool:
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as conn:
        try:
            return conn.execute("SELECT 1 FROM runs LIMIT 1").fetchone() is not None
        except sqlite3.OperationalError:  # no runs table yet
            return False


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{'a': {'b': 1}} -> {'a.b': '1'}; keys made MLflow-safe, values str()-ed and truncated."""
    out: dict[str, str] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten_params(v, prefix=f"{key}."))
        else:
            out[_name(key)] = clip(str(v), MAX_PARAM_VAL_LENGTH, unit=None)
    return out


def _tags(tags: Mapping[str, Any]) -> dict[str, str]:
    return {_name(str(k)): clip(str(v), MAX_TAG_VAL_LENGTH, unit=None) for k, v in tags.items()}


def _name(key: str) -> str:
    name = _BAD_NAME_CHARS.sub("_", key)[:MAX_ENTITY_KEY_LENGTH]
    # MLflow also rejects names that a path normalisation would change ('a//b', '/a', 'a/../b').
    if posixpath.normpath(name) != name:
        name = name.replace("/", "_")
    return name




def _dir_name(experiment: str) -> str:
    return re.sub(r"[^\w.\-]", "_", experiment) or "default"


__all__ = ["Tracker", "ensure_sqlite_store", "flatten_params", "RunStatus", "ui_url"]
