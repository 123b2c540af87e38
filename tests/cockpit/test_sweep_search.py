"""Search sweeps (mode tpe): validation that names the field, where studies are stored, asking for trials and
the pruning decision against completed trials (a real Optuna study on SQLite under FACTORY_HOME)."""

from pathlib import Path

import optuna
import pytest
from pydantic import ValidationError

from factory.cockpit.sweep import SweepDefinition, SweepError, member_key, plan_sweep
from factory.cockpit.sweep_search import (
    TrialReporter,
    ask,
    open_storage,
    open_study,
    postgres_driver_url,
    studies_db,
    study_storage_url,
)

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
LR = {"low": 1e-5, "high": 1e-3, "log": True}


def tpe(**kw) -> SweepDefinition:
    fields = {"base_spec": BASE, "mode": "tpe", "trials": 4, "space": {"algorithm.lr": LR},
              "overrides": {"schedule.eval_every": 2}, **kw}
    return SweepDefinition(**fields)


def test_a_tpe_sweep_plans_no_members_and_keeps_its_space():
    plan = plan_sweep(tpe(prune="median"), sweep_id="s")
    assert plan.members == [] and plan.sweep_id == "s"
    assert plan.definition.space["algorithm.lr"].log is True
    assert plan.base.schedule.eval_every == 2


@pytest.mark.parametrize("kw,named", [
    ({"space": {"algorithm.lr": {"low": 1e-5}}}, "space.algorithm.lr: give both low and high"),
    ({"space": {"algorithm.lr": {"low": 1e-3, "high": 1e-5}}}, "space.algorithm.lr.high: must be greater than low"),
    ({"space": {"algorithm.lr": {"low": 0.0, "high": 1e-3, "log": True}}},
     "space.algorithm.lr.low: must be > 0 with log: true"),
    ({"space": {"algorithm.lr": {"low": 1e-5, "high": 1e-3, "log": True, "step": 1e-5}}},
     "space.algorithm.lr.step: must be > 0 and not with log: true"),
    ({"space": {"algorithm.lrr": LR}}, "space.algorithm.lrr = 1e-05: algorithm.lrr: unknown key"),
    ({"space": {"algorithm.group_size": {"choices": [8, 1]}}},
     "space.algorithm.group_size = 1: algorithm.group_size: must be >= 2"),
    ({"space": {"algorithm.group_size": {"low": 2, "high": 8.5, "type": "int"}}},
     "space.algorithm.group_size: type int needs whole low, high and step"),
    ({"space": {"algorithm.group_size": {"choices": []}}}, "space.algorithm.group_size.choices: empty"),
    ({"space": {"algorithm.group_size": {"low": 2, "high": 8}}},
     "space.algorithm.group_size = 4.22: algorithm.group_size: Input should be a valid integer"),
    ({"space": {"x": {"choices": [[2, 3]]}}}, "space.x.choices: Optuna chooses among numbers"),
    ({"space": {"algorithm.lr": {"choices": [1e-4], "low": 1e-5}}}, "space.algorithm.lr: give either choices"),
    ({"space": {}}, "space: no parameters"),
    ({"trials": None}, "trials: mode tpe needs how many trials"),
    ({"axes": {"seed": [0, 1]}}, "axes: mode tpe searches `space`, not axes"),
    ({"samples": 3}, "samples: only for mode: random"),
    ({"prune": "median", "overrides": {}}, "prune: median stops members on their periodic evals"),
])
def test_a_bad_search_field_is_named_and_nothing_is_planned(kw, named):
    with pytest.raises(SweepError) as e:
        plan_sweep(tpe(**kw))
    assert any(line.startswith(named) for line in e.value.errors), e.value.errors
    assert "nothing was launched" in str(e.value)


@pytest.mark.parametrize("kw,named", [
    ({"space": {"algorithm.lr": LR}}, "space: only for mode: tpe"),
    ({"trials": 3}, "trials: only for mode: tpe"),
    ({"prune": "hyperband"}, "prune: only for mode: tpe"),
])
def test_search_fields_on_a_grid_sweep_are_refused_by_name(kw, named):
    with pytest.raises(SweepError) as e:
        plan_sweep(SweepDefinition(base_spec=BASE, axes={"seed": [0, 1]}, **kw))
    assert e.value.errors == [f"{named} (this sweep is mode: grid)"]


def test_an_unknown_key_of_a_searched_field_names_it():
    with pytest.raises(ValidationError, match=r"space\.`algorithm\.lr`\.lo\n.*Extra inputs are not permitted"):
        tpe(space={"algorithm.lr": {"lo": 1e-5, "high": 1e-3}})
    with pytest.raises(ValidationError, match=r"prune\n.*'median', 'hyperband' or 'none'"):
        tpe(prune="asha")


def test_studies_live_in_a_sqlite_file_under_factory_home_without_an_instance_postgres(factory_home):
    url = study_storage_url(factory_home, None)
    assert url == f"sqlite:///{factory_home.root / 'optuna' / 'studies.db'}" == f"sqlite:///{studies_db(factory_home)}"
    study = open_study(open_storage(url), "sweep-a", {"prune": "median"}, base_steps=8, eval_every=2)
    first = ask(study, {"algorithm.lr": tpe().space["algorithm.lr"]},
                member_of=lambda n, params: member_key("sweep-a", n, params))
    assert studies_db(factory_home).is_file()
    # A restart (a new process, a new storage object) continues the same study, found by the sweep id.
    again = optuna.load_study(study_name="sweep-a", storage=open_storage(url))
    (trial,) = again.get_trials()
    assert (trial.number, trial.params, trial.user_attrs["member"]) == (first.number, first.params,
                                                                           member_key("sweep-a", 0, first.params))
    assert trial.user_attrs["member"].startswith("sweep-a-m000-lr=")  # the key carries the trial's values
    # The pruner is not stored with the study: every opener builds the one the definition names.
    assert isinstance(open_study(open_storage(url), "sweep-a", {"prune": "none"}, 8, 2).pruner,
                      optuna.pruners.NopPruner)
    assert isinstance(open_study(open_storage(url), "sweep-a", {"prune": "hyperband"}, 8, 2).pruner,
                      optuna.pruners.HyperbandPruner)


def test_the_instance_postgres_is_where_studies_go_when_there_is_one(factory_home):
    pg = "postgresql://dagster:secret@db:5432/dagster"
    assert study_storage_url(factory_home, pg) == pg
    with pytest.raises(ValueError, match="instance_postgres_url: expected a postgresql:// URL, got 'mysql://x'"):
        study_storage_url(factory_home, "mysql://x")
    # Dagster's URLs name no driver; SQLAlchemy would pick psycopg 3, which is not installed: psycopg2 is.
    assert postgres_driver_url(pg) == "postgresql+psycopg2://dagster:secret@db:5432/dagster"
    assert postgres_driver_url("postgres://u@h/d") == "postgresql+psycopg2://u@h/d"
    assert postgres_driver_url("postgresql+psycopg2://u@h/d") == "postgresql+psycopg2://u@h/d"


def test_studies_on_postgres_get_a_schema_of_their_own(postgres_uri):
    import sqlalchemy

    driverless = postgres_uri.replace("postgresql+psycopg2://", "postgresql://", 1)  # as Dagster writes it
    study = open_study(open_storage(driverless), "sweep-pg", {}, 8, 2)
    study.ask()
    engine = sqlalchemy.create_engine(postgres_uri)
    with engine.connect() as conn:
        tables = {(s, t) for s, t in conn.execute(sqlalchemy.text(
            "SELECT table_schema, table_name FROM information_schema.tables"))}
    engine.dispose()
    assert ("optuna", "studies") in tables and ("optuna", "alembic_version") in tables
    assert ("public", "alembic_version") not in tables  # Dagster's own alembic table stays its own


def test_successive_asks_differ_and_a_sweep_replays_the_same_trials(factory_home, tmp_path):
    space = {"algorithm.lr": tpe().space["algorithm.lr"]}

    def three(url: str) -> list[float]:
        out = []
        for _ in range(3):  # each ask in a freshly opened study, as successive launcher ticks do
            study = open_study(open_storage(url), "s", {"draw_seed": 5}, 8, 2)
            out.append(ask(study, space, member_of=lambda n, params: str(n)).params["algorithm.lr"])
        return out

    a, b = three(study_storage_url(factory_home, None)), three(f"sqlite:///{tmp_path / 'other.db'}")
    assert len(set(a)) == 3 and all(1e-5 <= v <= 1e-3 for v in a)
    assert a == b


def _completed(study, value: float, at: dict[int, float]) -> None:
    dist = {"algorithm.lr": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True)}
    study.add_trial(optuna.trial.create_trial(params={"algorithm.lr": 1e-4}, distributions=dist, value=value,
                                              intermediate_values=at))


def test_the_median_pruner_prunes_a_trial_below_the_completed_ones_and_says_why(factory_home):
    study = open_study(open_storage(study_storage_url(factory_home, None)), "s",
                       {"prune": "median", "prune_startup_trials": 2}, 8, 2)
    _completed(study, 0.9, {2: 0.8, 4: 0.9})
    space = {"algorithm.lr": tpe().space["algorithm.lr"]}
    early = TrialReporter(study, ask(study, space, lambda n, params: str(n)).trial_id, "median")
    assert early.report(2, 0.1) is None  # one completed trial: fewer than prune_startup_trials
    _completed(study, 0.95, {2: 0.9, 4: 0.95})
    good = TrialReporter(study, ask(study, space, lambda n, params: str(n)).trial_id, "median")
    assert good.report(2, 0.86, n=100) is None
    bad = TrialReporter(study, ask(study, space, lambda n, params: str(n)).trial_id, "median")
    reason = bad.report(2, 0.5, n=100)
    assert reason == ("median pruner at step 2: held-out accuracy 0.500, below the median 0.850 of 2 completed "
                      "trial(s) at that step (diff -0.350 [-0.462, -0.223], n=100 each: outside the noise)")
    bad.pruned()
    good.complete(0.97)
    states = {t.number: t.state for t in study.get_trials()}
    assert states[bad.trial_number()] == optuna.trial.TrialState.PRUNED
    assert states[good.trial_number()] == optuna.trial.TrialState.COMPLETE
    bad.complete(0.99)  # a retried member whose trial already ended leaves it as it is
    assert study.get_trials()[bad.trial_number()].state == optuna.trial.TrialState.PRUNED
    assert bad.report(4, 0.0) is None


def test_the_hyperband_pruner_stops_a_trial_far_below_the_finished_ones(factory_home):
    study = open_study(open_storage(study_storage_url(factory_home, None)), "hb", {"prune": "hyperband"}, 8, 2)
    space = {"algorithm.lr": tpe().space["algorithm.lr"]}
    for _ in range(12):  # finished trials at 0.9 at every eval, spread over Hyperband's brackets
        done = TrialReporter(study, ask(study, space, lambda n, params: str(n)).trial_id, "hyperband")
        assert [done.report(step, 0.9, n=100) for step in (2, 4, 6)] == [None, None, None]
        done.complete(0.9)
    for _ in range(4):  # in whichever bracket a trial falls, a rung by step 6 stops it
        bad = TrialReporter(study, ask(study, space, lambda n, params: str(n)).trial_id, "hyperband")
        reasons = [r for r in (bad.report(step, 0.0, n=100) for step in (2, 4, 6)) if r]
        assert reasons and all(r.startswith("hyperband pruner at step ") and r.endswith("outside the noise)")
                               for r in reasons), reasons


def test_a_member_below_the_median_inside_the_noise_is_not_pruned_and_says_so(factory_home):
    """Issue 32: pruned at 0.674 against a median of 0.680 (n=500), a difference of -0.006 [-0.064, +0.052]."""
    study = open_study(open_storage(study_storage_url(factory_home, None)), "noise",
                       {"prune": "median", "prune_startup_trials": 2}, 8, 2)
    _completed(study, 0.7, {2: 0.68, 4: 0.7})
    _completed(study, 0.7, {2: 0.68, 4: 0.7})
    space = {"algorithm.lr": tpe().space["algorithm.lr"]}
    said: list[str] = []
    member = TrialReporter(study, ask(study, space, lambda n, params: str(n)).trial_id, "median", log=said.append)
    assert member.report(2, 0.674, n=500) is None  # the pruner says stop: below the median, but inside the noise
    assert said == member.spared == ["median pruner at step 2: held-out accuracy 0.674, below the median 0.680 of 2 "
                                     "completed trial(s) at that step, but inside the noise (diff -0.006 [-0.064, "
                                     "+0.052], n=500 each): not pruned"]
    assert member.running() and member.reason is None
    # far below at the next eval: outside the noise, pruned, and the reason gives the interval
    assert member.report(4, 0.5, n=500).endswith("(diff -0.200 [-0.258, -0.140], n=500 each: outside the noise)")


def test_settings_that_make_pruning_act_inside_the_noise_are_warned_about():
    noisy = plan_sweep(tpe(prune="median", prune_startup_trials=1,
                           overrides={"schedule.eval_every": 2, "task.n_eval": 50}), sweep_id="w")
    assert noisy.warnings == [
        "task.n_eval: each periodic eval the median pruner decides on has n=50 held-out problems: near 0.5 two "
        "accuracies must differ by more than 0.196 to be told apart (95%), and a member inside that is not pruned, "
        "so pruning will act seldom and only far below; n_eval=392 gives 0.070",
        "prune_startup_trials: 1: the median of fewer than 2 completed trials is one trial's own eval, noise and "
        "all; give 2 or more"]
    assert plan_sweep(tpe(prune="median", overrides={"schedule.eval_every": 2, "task.n_eval": 500}),
                      sweep_id="q").warnings == []
    assert plan_sweep(tpe(overrides={"task.n_eval": 50}), sweep_id="n").warnings == []  # no pruning: nothing to warn
