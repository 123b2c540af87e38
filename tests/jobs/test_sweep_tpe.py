"""A tpe sweep launched from the launchpad: the sweep job's config takes the search fields, the study is created on
the instance's storage, and the launcher asks Optuna for trials only as the sweep's slots free up, each a member
with its trial number and parameters as tags, until `trials` were asked. Real Dagster runs in a temp instance;
runs the launcher sees in flight or finished are run records made with Dagster's `create_run_for_test`."""

import json
import time
from pathlib import Path

import optuna
import pytest
from dagster import AssetMaterialization, DagsterInstance, DagsterRunStatus, build_sensor_context
from dagster._core.test_utils import create_run_for_test
from dagster._daemon.types import DaemonHeartbeat

from assets.sweeps import sweep_members, sweeps, warm_starts
from factory.cockpit.sweep import member_key, read_member, read_sweep
from factory.cockpit.sweep_search import TRIAL_TAG, open_storage, study_storage_url
from factory.lake import Lake
from jobs import defs
from jobs.sweeps import sweep, sweep_launcher, sweep_summarizer

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=2", "schedule.eval_pass_k=2"]
SPACE = {"algorithm.lr": {"low": 1.0e-4, "high": 1.0e-3, "log": True}}


@pytest.fixture
def instance(factory_home):
    with DagsterInstance.ephemeral() as inst:
        inst.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "SENSOR", None, []))
        yield inst


def launch(instance, **config):
    cfg = {"name": "tpe", "base_spec": BASE, "overrides": [*TINY, "schedule.eval_every=1"], **config}
    return defs.resolve_job_def("sweep").execute_in_process(
        run_config={"ops": {"plan_and_queue_sweep": {"config": cfg}}}, instance=instance, raise_on_error=False)


def tick(instance, cursor=None, sensor=sweep_launcher):
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources) as ctx:
        return sensor(ctx)


def _failure(result) -> str:
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return failure.event_specific_data.user_failure_data.description


def test_the_sweep_job_config_takes_the_search_fields():
    op = sweep.run_config_schema.config_type.fields["ops"].config_type.fields["plan_and_queue_sweep"]
    fields = op.config_type.fields["config"].config_type.fields
    assert {"mode", "space", "trials", "prune", "prune_startup_trials", "max_concurrent"} <= set(fields)
    assert not any(fields[k].is_required for k in ("space", "trials", "prune", "axes"))


@pytest.mark.slow
def test_a_bad_search_field_fails_the_launch_in_one_line_naming_it(instance, factory_home):
    bad = launch(instance, mode="tpe", trials=3, space={"algorithm.lr": {"low": 1e-3, "high": 1e-4}})
    assert not bad.success
    assert _failure(bad) == ("invalid sweep (nothing was launched): space.algorithm.lr.high: must be greater than "
                             "low (got low=0.001, high=0.0001)")
    assert not (factory_home.root / "sweeps").exists()
    no_evals = launch(instance, mode="tpe", trials=3, prune="median", space=SPACE,
                      overrides=[*TINY, "schedule.eval_every=0"])
    assert "prune: median stops members on their periodic evals" in _failure(no_evals)


@pytest.mark.slow
def test_trials_are_asked_as_slots_free_up_until_the_budget_is_spent(instance, factory_home):
    result = launch(instance, mode="tpe", trials=3, max_concurrent=2, prune="median", space=SPACE)
    assert result.success, [str(e.event_specific_data.error) for e in result.all_events
                            if e.event_type_value == "STEP_FAILURE"]
    sweep_id = result.output_for_node("plan_and_queue_sweep")["sweep_id"]
    assert instance.get_dynamic_partitions(sweeps.name) == [sweep_id]
    assert read_sweep(factory_home, sweep_id)["members"] == []
    # The study exists on the instance's storage (SQLite under FACTORY_HOME here), named after the sweep.
    storage = open_storage(study_storage_url(factory_home, None))
    assert optuna.load_study(study_name=sweep_id, storage=storage).get_trials() == []

    # 1. Two slots: two trials are asked; they share one warm start, which is launched first, alone.
    first = tick(instance)
    (ws_req,) = first.run_requests
    study = optuna.load_study(study_name=sweep_id, storage=storage)
    assert len(study.get_trials()) == 2
    keys = [member_key(sweep_id, t.number, t.params) for t in study.get_trials()]  # <sweep_id>-m000-lr=...
    assert [k.partition("=")[0] for k in keys] == [f"{sweep_id}-m000-lr", f"{sweep_id}-m001-lr"]
    assert instance.get_dynamic_partitions(sweep_members.name) == keys
    assert instance.get_dynamic_partitions(warm_starts.name) == [ws_req.partition_key]
    rows = {r["member"]: r for r in Lake.open(factory_home).read("sweeps").to_pylist()}
    assert sorted(rows) == keys and {r["status"] for r in rows.values()} == {"queued"}
    for t in study.get_trials():
        spec, values = read_member(factory_home, keys[t.number])
        assert values == t.params and spec.algorithm.lr == t.params["algorithm.lr"]
        assert json.loads(rows[keys[t.number]]["axes"]) == t.params
    assert tick(instance, first.cursor).run_requests == [ws_req]  # idempotent: no new trial while they wait

    # 2. The warm start is ready: both members start, tagged with their trial and parameters.
    instance.report_runless_asset_event(AssetMaterialization("sweep_warm_start", partition=ws_req.partition_key))
    second = tick(instance, first.cursor)
    assert [r.partition_key for r in second.run_requests] == keys
    for n, req in enumerate(second.run_requests):
        assert req.tags[TRIAL_TAG] == str(n)
        assert float(req.tags["axis/algorithm.lr"]) == pytest.approx(study.get_trials()[n].params["algorithm.lr"])
    runs = [create_run_for_test(instance, job_name="sweep_member_job", tags=r.tags, status=DagsterRunStatus.STARTED)
            for r in second.run_requests]
    assert tick(instance, second.cursor).run_requests == []  # both slots taken: nothing asked
    assert len(optuna.load_study(study_name=sweep_id, storage=storage).get_trials()) == 2

    # 3. Both end: one more trial (the budget is 3), then the launcher is done with the sweep.
    for run, req in zip(runs, second.run_requests, strict=True):
        instance.delete_run(run.run_id)
        create_run_for_test(instance, job_name="sweep_member_job", tags=req.tags, status=DagsterRunStatus.SUCCESS)
    third = tick(instance, second.cursor)
    trials = optuna.load_study(study_name=sweep_id, storage=storage).get_trials()
    assert [r.partition_key for r in third.run_requests] == [member_key(sweep_id, 2, trials[2].params)]
    assert len(trials) == 3 and trials[2].user_attrs["member"] == third.run_requests[0].partition_key
    assert read_sweep(factory_home, sweep_id)["search_done"] is True
    assert json.loads(third.cursor) == [sweep_id]
    # The summary waits for the members' rows to end (queued here), pruned counting as ended.
    assert tick(instance, sensor=sweep_summarizer).run_requests == []



def execute(instance, request, job_name=None):
    """Run what a sensor requested, the way the daemon would: the requested job, partition and tags."""
    result = defs.resolve_job_def(job_name or request.job_name).execute_in_process(
        instance=instance, partition_key=request.partition_key, tags=request.tags, raise_on_error=False)
    assert result.success, [str(e.event_specific_data.error) for e in result.all_events
                            if e.event_type_value == "STEP_FAILURE"]
    return result


@pytest.mark.slow
def test_a_member_run_through_dagster_is_pruned_and_the_sweep_is_summarized(instance, factory_home):
    result = launch(instance, mode="tpe", trials=3, max_concurrent=1, prune="median", prune_startup_trials=2,
                    space=SPACE)
    sweep_id = result.output_for_node("plan_and_queue_sweep")["sweep_id"]
    # Two trials that finished perfect at the step-1 eval, as earlier members would have: the third must be below.
    study = optuna.load_study(study_name=sweep_id, storage=open_storage(study_storage_url(factory_home, None)))
    dist = {"algorithm.lr": optuna.distributions.FloatDistribution(1e-4, 1e-3, log=True)}
    for lr in (2e-4, 5e-4):
        study.add_trial(optuna.trial.create_trial(params={"algorithm.lr": lr}, distributions=dist, value=1.0,
                                                  intermediate_values={1: 1.0}))
    first = tick(instance)
    (ws,) = first.run_requests  # one trial asked (the budget is 3); its warm start first
    execute(instance, ws)
    second = tick(instance, first.cursor)
    (member,) = second.run_requests
    assert member.partition_key.startswith(f"{sweep_id}-m002-lr=") and member.tags[TRIAL_TAG] == "2"
    run = execute(instance, member)
    md = run.asset_materializations_for_node("sweep_member_run")[0].metadata
    assert md["status"].value == "pruned" and md["trial"].value == 2
    # Dagster says SUCCESS (the member ended as meant); the run's `factory/status` tag says how, as everywhere else
    dagster_run = instance.get_run_by_id(run.run_id)
    assert (dagster_run.status.value, dagster_run.tags["factory/status"]) == ("SUCCESS", "pruned")
    assert md["reason"].value.startswith("median pruner at step 1: held-out accuracy ")
    (row,) = Lake.open(factory_home).read("sweeps").to_pylist()
    assert (row["status"], row["reason"]) == ("pruned", md["reason"].value)
    assert study.get_trials()[2].state == optuna.trial.TrialState.PRUNED
    assert json.loads(second.cursor) == [sweep_id]  # every trial asked and started
    # Pruned counts as ended: the summary comes, and says how many were pruned.
    (summary,) = tick(instance, sensor=sweep_summarizer).run_requests
    done = execute(instance, summary, job_name="sweep_summary_job")
    smd = done.asset_materializations_for_node("sweep_summary")[0].metadata
    assert (smd["members"].value, smd["pruned"].value, smd["succeeded"].value) == (1, 1, 0)
