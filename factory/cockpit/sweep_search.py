"""Search sweeps (`mode: tpe`) through Optuna: the search space, where studies are stored, asking for trials,
and reporting a member's periodic evals so that a hopeless member is pruned.

A tpe sweep has no member list up front. Its launcher asks the study for a trial whenever the sweep has a free
slot (fewer than `max_concurrent` runs in flight) and fewer than `trials` were asked; each trial becomes a
normal sweep member (`<sweep_id>-m<trial number>`, its spec the base spec with the trial's parameters applied).
The member run reports its held-out accuracy at each periodic eval (`schedule.eval_every`) as the trial's
intermediate value; when the sweep's pruner says the trial is worse than the finished ones at that step, and the
difference is outside the noise of the two evals (Newcombe's 95% interval of the member's accuracy minus the
pruner's reference excludes 0; `TrialReporter.report`), the run stops at a resume point (it stays resumable) and the
trial is told it was pruned; inside the noise the member goes on, and its log says so. A member that finishes tells
the study its final held-out accuracy (the objective, maximized). `prune_warnings` names settings under which most
differences the pruner sees are inside the noise.

Storage: the study lives in the database the Dagster instance uses, so it is backed up and shared with it: the
instance's Postgres when it is on Postgres (in a schema of its own, `optuna`, because Optuna and Dagster both
keep an `alembic_version` table), else a SQLite file FACTORY_HOME/optuna/studies.db. The study is named after
the sweep id, so a restarted launcher or a retried member continues the same study.

Optuna is imported on first use (`_optuna`): loading the code location and `factory validate` stay light.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from factory.config import ExperimentSpec, SpecError, apply_overrides
from factory.envs.spec_check import check_spec
from factory.home import FactoryPaths
from factory.intervals import Z95, newcombe

if TYPE_CHECKING:
    import optuna

PRUNERS = ("median", "hyperband", "none")
OPTUNA_SCHEMA = "optuna"  # the Postgres schema of the studies, beside the Dagster instance's tables
TRIAL_TAG = "factory/trial"  # run tag: the Optuna trial number of a tpe sweep's member


class SearchParam(BaseModel):
    """One searched spec field: `{choices: [...]}`, or a range `{low, high}` (with `log`, `step`, `type: int`)."""

    model_config = ConfigDict(extra="forbid")

    low: float | None = Field(None, description="the range's lower bound (inclusive)")
    high: float | None = Field(None, description="the range's upper bound (inclusive)")
    log: bool = Field(False, description="sample the range on a log scale (low must be > 0)")
    step: float | None = Field(None, description="sample the range on a grid of this step (not with log)")
    type: Literal["float", "int"] = Field("float", description="int: whole numbers (suggest_int)")
    choices: list[Any] | None = Field(None, description="the values to choose from (numbers, strings, booleans)")


def studies_db(paths: FactoryPaths) -> Path:
    """The SQLite file of the studies when the Dagster instance is not on Postgres."""
    return paths.root / "optuna" / "studies.db"


def study_storage_url(paths: FactoryPaths, instance_postgres_url: str | None) -> str:
    """Where the studies are stored: the Dagster instance's Postgres (`instance_postgres_url`, as the instance
    has it) when it has one, else the SQLite file `studies_db(paths)` under FACTORY_HOME."""
    if instance_postgres_url:
        if not instance_postgres_url.startswith(("postgresql", "postgres")):
            raise ValueError(f"instance_postgres_url: expected a postgresql:// URL, got {instance_postgres_url!r}")
        return instance_postgres_url
    return f"sqlite:///{studies_db(paths)}"


def postgres_driver_url(url: str) -> str:
    """`url` naming the psycopg2 driver when it names none: Dagster writes `postgresql://...`, which SQLAlchemy 2.1
    maps to psycopg 3, and Factory installs psycopg2 (pyproject)."""
    scheme, sep, rest = url.partition("://")
    return f"postgresql+psycopg2://{rest}" if sep and scheme in ("postgres", "postgresql") else url


def _optuna() -> ModuleType:
    """Optuna, imported on first use."""
    import optuna  # noqa: PLC0415 heavy: optuna (sqlalchemy, alembic); the code location and validate never use it

    return optuna


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage at `url` (see `study_storage_url`), its tables created on first use: on Postgres in the
    schema `optuna` (created if missing), so Dagster's tables and alembic version stay untouched."""
    optuna = _optuna()
    import sqlalchemy  # noqa: PLC0415 heavy: sqlalchemy; with optuna, used by a tpe sweep only

    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        # The launcher sensor and every member's process share the file: wait for a lock rather than fail.
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    url = postgres_driver_url(url)
    engine = sqlalchemy.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(f"CREATE SCHEMA IF NOT EXISTS {OPTUNA_SCHEMA}"))
    finally:
        engine.dispose()
    return optuna.storages.RDBStorage(
        url, engine_kwargs={"connect_args": {"options": f"-csearch_path={OPTUNA_SCHEMA}"}})


# ---------------------------------------------------------------- the definition's search fields


def search_errors(defn: Any, base: ExperimentSpec | None) -> list[str]:
    """Problems of a sweep definition's search fields (`mode`, `trials`, `space`, `prune`), one line each naming
    its field; `defn` is a `factory.cockpit.sweep.SweepDefinition`, `base` its base spec (overrides applied; needed for
    mode tpe only)."""
    if defn.mode != "tpe":
        return [f"{name}: only for mode: tpe (this sweep is mode: {defn.mode})"
                for name, given in (("space", bool(defn.space)), ("trials", defn.trials is not None),
                                    ("prune", defn.prune != "none")) if given]
    errors = []
    if defn.axes:
        errors.append("axes: mode tpe searches `space`, not axes; write an axis as space.<field>: {choices: [...]}")
    if defn.samples is not None:
        errors.append("samples: only for mode: random (mode tpe runs `trials` trials)")
    if defn.trials is None:
        errors.append("trials: mode tpe needs how many trials to run, e.g. trials: 20")
    if not defn.space:
        errors.append("space: no parameters (give at least one spec field path with {low, high} or {choices})")
    for name, p in defn.space.items():
        errors += _param_errors(name, p, base)
    if defn.prune != "none" and not base.schedule.eval_every:
        errors.append(f"prune: {defn.prune} stops members on their periodic evals, and the base spec has none: set "
                      f"schedule.eval_every (in the base spec or overrides), or prune: none")
    return errors


# A periodic eval whose difference from the pruner's reference must exceed this (at accuracies near 0.5) to be outside
# the noise makes pruning act seldom, and only far below: `prune_warnings` says so.
NOISY_DIFF = 0.10
MIN_STARTUP_TRIALS = 2  # the median of fewer completed trials is one trial's own eval, noise included


def diff_half_width(n: int, p: float = 0.5) -> float:
    """The half-width of the 95% interval of a difference of two accuracies near `p`, each on n problems."""
    return Z95 * math.sqrt(2 * p * (1 - p) / n)


def prune_warnings(defn: Any, base: ExperimentSpec) -> list[str]:
    """Settings of a tpe sweep (`defn`, its base spec `base`) under which the pruner sees differences mostly inside
    the noise of its evals, one line each naming the setting; empty without pruning."""
    if defn.mode != "tpe" or defn.prune == "none" or not base.schedule.eval_every:
        return []
    out = []
    n = base.task.n_eval
    half = diff_half_width(n)
    if half > NOISY_DIFF:
        better = math.ceil(2 * 0.25 * (Z95 / 0.07) ** 2)
        out.append(f"task.n_eval: each periodic eval the {defn.prune} pruner decides on has n={n} held-out problems: "
                   f"near 0.5 two accuracies must differ by more than {half:.3f} to be told apart (95%), and a member "
                   f"inside that is not pruned, so pruning will act seldom and only far below; n_eval={better} "
                   "gives 0.070")
    if defn.prune == "median" and defn.prune_startup_trials < MIN_STARTUP_TRIALS:
        out.append(f"prune_startup_trials: {defn.prune_startup_trials}: the median of fewer than "
                   f"{MIN_STARTUP_TRIALS} completed trials is one trial's own eval, noise and all; give "
                   f"{MIN_STARTUP_TRIALS} or more")
    return out


def _param_errors(name: str, p: SearchParam, base: ExperimentSpec) -> list[str]:
    where = f"space.{name}"
    if p.choices is not None:
        if any(v is not None for v in (p.low, p.high, p.step)) or p.log:
            return [f"{where}: give either choices or a range (low, high, log, step), not both"]
        if not p.choices:
            return [f"{where}.choices: empty (give at least one value)"]
        bad = [v for v in p.choices if v is not None and not isinstance(v, bool | int | float | str)]
        if bad:
            return [f"{where}.choices: Optuna chooses among numbers, strings, booleans or null; got {bad[0]!r}"]
        values = list(p.choices)
    else:
        if p.low is None or p.high is None:
            return [f"{where}: give both low and high (a range), or choices"]
        if not (math.isfinite(p.low) and math.isfinite(p.high)):
            return [f"{where}: low and high must be finite numbers (got low={p.low}, high={p.high})"]
        if p.high <= p.low:
            return [f"{where}.high: must be greater than low (got low={p.low}, high={p.high})"]
        if p.log and p.low <= 0:
            return [f"{where}.low: must be > 0 with log: true (got {p.low})"]
        if p.step is not None and (p.log or p.step <= 0):
            return [f"{where}.step: must be > 0 and not with log: true (got step={p.step}, log={p.log})"]
        if p.type == "int" and any(v is not None and v != int(v) for v in (p.low, p.high, p.step)):
            return [f"{where}: type int needs whole low, high and step (got low={p.low}, high={p.high}, "
                    f"step={p.step})"]
        values = [_typed(p, p.low), _typed(p, p.high)]
        if p.type == "float" and p.step is None:  # a value inside too: a whole-number field needs type: int
            values.append(p.low * (p.high / p.low) ** 0.37 if p.log else p.low + 0.37 * (p.high - p.low))
    errors = []
    for v in values:  # the ends of a range and every choice must make a valid spec on their own
        try:
            check_spec(apply_overrides(base, {name: v}))
        except SpecError as e:
            errors += [f"{where} = {v!r}: {line}" for line in e.errors]
    return errors


def _typed(p: SearchParam, v: float) -> int | float:
    return int(v) if p.type == "int" else float(v)


def distributions(space: dict[str, SearchParam]) -> dict[str, optuna.distributions.BaseDistribution]:
    """Optuna's distribution of each searched field (the space validated by `search_errors`)."""
    dist = _optuna().distributions
    out: dict[str, Any] = {}
    for name, p in space.items():
        if p.choices is not None:
            out[name] = dist.CategoricalDistribution(p.choices)
        elif p.type == "int":
            out[name] = dist.IntDistribution(int(p.low), int(p.high), log=p.log, step=int(p.step or 1))
        else:
            out[name] = dist.FloatDistribution(p.low, p.high, log=p.log, step=p.step)
    return out


# ---------------------------------------------------------------- the study


def _pruner(prune: str, startup_trials: int, first_step: int, last_step: int) -> optuna.pruners.BasePruner:
    optuna = _optuna()

    if prune == "median":
        # The median of the trials that reached the same step; none pruned before `startup_trials` completed.
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=0)
    if prune == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, first_step), max_resource=max(1, last_step))
    return optuna.pruners.NopPruner()


def open_study(storage: optuna.storages.BaseStorage, sweep_id: str, definition: dict[str, Any],
               base_steps: int, eval_every: int | None) -> optuna.Study:
    """The sweep's study (created on first use, else loaded: same name, same storage), with the sampler and
    pruner its definition names (`definition`: a `SweepDefinition` as JSON). The TPE sampler is seeded with
    `draw_seed` plus the number of trials already asked, so trials asked by successive launcher ticks differ and
    a sweep replays the same way."""
    optuna = _optuna()

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial otherwise, in every sensor tick
    pruner = _pruner(definition.get("prune", "none"), int(definition.get("prune_startup_trials", 3)),
                     eval_every or 1, base_steps)
    study = optuna.create_study(study_name=sweep_id, storage=storage, direction="maximize", pruner=pruner,
                                load_if_exists=True)
    seed = int(definition.get("draw_seed", 0)) + len(study.get_trials(deepcopy=False))
    # TPE samples at random for its first trials; Optuna's 10 would be a whole small budget, so a third of it.
    startup = min(10, max(1, int(definition.get("trials") or 30) // 3))
    study.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
    return study


@dataclass(frozen=True)
class AskedTrial:
    number: int
    trial_id: int  # the storage's id of the trial (what a member process opens it by)
    params: dict[str, Any]


def ask(study: optuna.Study, space: dict[str, SearchParam], member_of: Any) -> AskedTrial:
    """A new trial of `study` over `space`; `member_of(number, params)` names its member (its key carries the
    trial's values), stored on the trial."""
    trial = study.ask(distributions(space))
    trial.set_user_attr("member", member_of(trial.number, dict(trial.params)))
    return AskedTrial(trial.number, trial._trial_id, dict(trial.params))


class TrialReporter:
    """A member run's side of its trial: `report(step, accuracy, n)` after each periodic eval returns why the member
    is pruned (or None to go on); `complete(accuracy)` and `pruned()` finish the trial once. A trial that is
    already finished (a retried member) is left as it is. `log` gets a line whenever the pruner would have stopped
    the member on a difference inside the noise."""

    def __init__(self, study: optuna.Study, trial_id: int, prune: str, log: Callable[[str], None] | None = None):
        optuna = _optuna()

        self.study, self.trial_id, self.prune, self.log = study, trial_id, prune, log
        self.trial = optuna.trial.Trial(study, trial_id)
        self.reason: str | None = None  # set when `report` decided to prune
        self.spared: list[str] = []  # each time the pruner said stop but the difference was inside the noise

    def _frozen(self) -> optuna.trial.FrozenTrial:
        # The trial's current record (another process may have finished it); Optuna's Study has no public way
        # to get one trial by id.
        return self.study._storage.get_trial(self.trial_id)

    def running(self) -> bool:
        optuna = _optuna()

        return self._frozen().state == optuna.trial.TrialState.RUNNING

    def report(self, step: int, accuracy: float, n: int | None = None) -> str | None:
        """Report the held-out `accuracy` measured on `n` problems at `step`; the reason to prune, or None. The
        pruner's word is followed only when the accuracy is below its reference (the median of the completed trials
        at that step; for hyperband, of the other trials there) by more than the noise: Newcombe's 95% interval of
        the difference, the reference taken as one accuracy on as many problems, excludes 0."""
        if not self.running():
            return None
        if step not in self._frozen().intermediate_values:  # a resumed attempt reports a step once
            self.trial.report(accuracy, step)
        if self.prune == "none" or not self.trial.should_prune():
            return None
        reference = self._reference(step)
        base = f"{self.prune} pruner at step {step}: held-out accuracy {accuracy:.3f}"
        if reference is None:
            self.reason = base
            return self.reason
        value, count, what = reference
        below = f"{base}, below the median {value:.3f} of {count} {what} at that step"
        if not n:
            self.reason = f"{below} (n unknown: not checked against the noise)"
            return self.reason
        ci = newcombe(round(accuracy * n), n, round(value * n), n)
        diff = f"diff {accuracy - value:+.3f} [{ci.low:+.3f}, {ci.high:+.3f}], n={n} each"
        if ci.high < 0:
            self.reason = f"{below} ({diff}: outside the noise)"
            return self.reason
        note = f"{below}, but inside the noise ({diff}): not pruned"
        self.spared.append(note)
        if self.log is not None:
            self.log(note)
        return None

    def _reference(self, step: int) -> tuple[float, int, str] | None:
        """(value, how many trials, which) the pruner compared this trial with at `step`: the median of the
        completed trials' values there (median); of every other trial's (hyperband, which ranks within a rung)."""
        optuna = _optuna()

        if self.prune == "median":
            trials, what = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)), \
                "completed trial(s)"
        else:
            trials, what = [t for t in self.study.get_trials(deepcopy=False) if t._trial_id != self.trial_id], \
                "other trial(s)"
        at_step = [t.intermediate_values[step] for t in trials if step in t.intermediate_values]
        return (statistics.median(at_step), len(at_step), what) if at_step else None

    def complete(self, accuracy: float) -> None:
        if self.running():
            self.study.tell(self.trial_number(), accuracy)

    def pruned(self) -> None:
        optuna = _optuna()

        if self.running():
            self.study.tell(self.trial_number(), state=optuna.trial.TrialState.PRUNED)

    def trial_number(self) -> int:
        return self._frozen().number
