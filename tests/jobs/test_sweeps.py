"""The sweep job, its launcher and summarizer, evals in between: real Dagster runs in a temp instance.

Each run a sensor requests is executed in process with the request's tags, as the daemon would launch it,
so the sensors see real runs in the instance: the limit, the shared warm start, the tags, the evals owed
and the summary are all checked against what actually ran. Runs seen "in flight" are made with Dagster's
test utility `create_run_for_test` (a run record in STARTED state), which is all the sensors look at.
"""

import json
import re
import time
from pathlib import Path

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    DagsterRunStatus,
    build_sensor_context,
)
from dagster._core.test_utils import create_run_for_test
from dagster._daemon.types import DaemonHeartbeat

from assets.sweeps import sweep_members, sweeps, warm_starts
from factory.cockpit.reports import compare_sweep
from factory.cockpit.sweep import member_short, short_label
from factory.cockpit.tracking import Tracker
from factory.lake import Lake
from jobs import defs
from jobs.evals import new_checkpoint_evals
from jobs.sweeps import EXAMPLE_SWEEP, sweep, sweep_launcher, sweep_summarizer

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=2", "schedule.eval_pass_k=2"]


def launch(instance, **config):
    cfg = {"name": "t", "base_spec": BASE, "overrides": TINY, **config}
    return defs.resolve_job_def("sweep").execute_in_process(
        run_config={"ops": {"plan_and_queue_sweep": {"config": cfg}}}, instance=instance, raise_on_error=False)


def daemon_running(instance) -> None:
    """What a running dagster-daemon leaves in the instance: a recent heartbeat of its sensor loop."""
    instance.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "SENSOR", None, []))


def tick(sensor, instance, cursor=None):
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources) as ctx:
        return sensor(ctx)


def execute(instance, request):
    """Run what a sensor requested, the way the daemon would: the requested job, partition and tags."""
    result = defs.resolve_job_def(request.job_name or _job_of(request)).execute_in_process(
        instance=instance, partition_key=request.partition_key, tags=request.tags, raise_on_error=False)
    assert result.success, [str(e.event_specific_data.error) for e in result.all_events
                            if e.event_type_value == "STEP_FAILURE"]
    return result


def _job_of(request) -> str:
    return "checkpoint_eval_job" if "factory/checkpoint" in request.tags else "sweep_summary_job"


@pytest.fixture
def instance(factory_home):
    with DagsterInstance.ephemeral() as inst:
        yield inst


def _failure(result) -> str:
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return failure.event_specific_data.user_failure_data.description


@pytest.mark.slow
def test_a_bad_axis_or_base_spec_fails_in_one_line_and_launches_nothing(instance, factory_home):
    daemon_running(instance)
    bad_axis = launch(instance, axes={"algorithm.lr": [1e-5], "algorithm.grup_size": [4, 8]})
    assert not bad_axis.success
    assert "axes.algorithm.grup_size = 4: algorithm.grup_size: unknown key" in _failure(bad_axis)
    bad_path = launch(instance, base_spec="examples/quickstrt.yaml", axes={"seed": [0]})
    assert _failure(bad_path) == ("invalid sweep (nothing was launched): base_spec examples/quickstrt.yaml: "
                                  "no such spec file: examples/quickstrt.yaml")
    assert "\n" not in _failure(bad_path)
    assert instance.get_dynamic_partitions(sweep_members.name) == []
    assert not (factory_home.root / "sweeps").exists()
    assert Lake.open(factory_home).read("sweeps").num_rows == 0
    assert tick(sweep_launcher, instance).run_requests == []


def test_a_sweep_is_refused_when_no_daemon_would_launch_its_members(instance, factory_home):
    result = launch(instance, axes={"seed": [0, 1]})
    assert not result.success
    assert _failure(result).startswith("sweep refused (nothing was launched): no dagster daemon is running sensors")
    assert instance.get_dynamic_partitions(sweep_members.name) == []


def test_the_launchpad_example_is_a_valid_sweep_with_real_axes():
    from factory.cockpit.sweep import SweepDefinition, plan_sweep
    from factory.config import parse_overrides

    assert EXAMPLE_SWEEP["axes"]  # it sweeps something
    plan = plan_sweep(SweepDefinition(**{**EXAMPLE_SWEEP, "overrides": parse_overrides(EXAMPLE_SWEEP["overrides"])}))
    assert len(plan.members) == 2 and len(plan.warm_starts()) == 1
    assert sweep.run_config_schema.config_type.fields["ops"] is not None
    # A grid sweep gives axes, a tpe sweep a space: neither is required by the config; plan_sweep names what is missing.
    assert {"axes", "space", "trials"} <= _optional_op_fields()


def _optional_op_fields() -> set[str]:
    op = sweep.run_config_schema.config_type.fields["ops"].config_type.fields["plan_and_queue_sweep"]
    fields = op.config_type.fields["config"].config_type.fields
    return {k for k, f in fields.items() if not f.is_required}


@pytest.mark.slow
def test_one_warm_start_then_members_within_the_limit_then_evals_then_the_summary(instance, factory_home):
    daemon_running(instance)
    result = launch(instance, axes={"algorithm.lr": [1e-3, 3e-3]}, max_concurrent=1)
    assert result.success
    out = result.output_for_node("plan_and_queue_sweep")
    sweep_id, keys = out["sweep_id"], out["members"]
    assert keys == [f"{sweep_id}-m000-lr=1e-3", f"{sweep_id}-m001-lr=3e-3"]  # readable keys
    (ws,) = instance.get_dynamic_partitions(warm_starts.name)
    assert instance.get_dynamic_partitions(sweep_members.name) == keys
    assert instance.get_dynamic_partitions(sweeps.name) == [sweep_id]

    # 1. The shared warm start first, alone (max_concurrent 1): the members wait for it.
    first = tick(sweep_launcher, instance)
    (req,) = first.run_requests
    assert req.partition_key == ws and req.tags["factory/warm_start"] == ws
    busy = create_run_for_test(instance, job_name="sweep_warm_start_job", tags=req.tags,
                               status=DagsterRunStatus.STARTED)
    assert tick(sweep_launcher, instance, first.cursor).run_requests == []  # in flight: nothing else starts
    instance.delete_run(busy.run_id)
    execute(instance, req)

    # 2. Members one at a time, tagged with their axis values.
    seen = []
    cursor = first.cursor
    for _ in keys:
        res = tick(sweep_launcher, instance, cursor)
        (member,) = res.run_requests
        assert tick(sweep_launcher, instance, cursor).run_requests == res.run_requests  # idempotent until it runs
        busy = create_run_for_test(instance, job_name="sweep_member_job", tags=member.tags,
                                   status=DagsterRunStatus.STARTED)
        assert tick(sweep_launcher, instance, res.cursor).run_requests == []  # limit 1: the next one waits
        instance.delete_run(busy.run_id)
        run = execute(instance, member)
        seen.append((member, run))
        cursor = res.cursor
    assert [m.partition_key for m, _ in seen] == keys
    assert [m.tags["axis/algorithm.lr"] for m, _ in seen] == ["0.001", "0.003"]
    assert json.loads(cursor) == [sweep_id]  # every member started: the launcher is done with this sweep
    assert tick(sweep_launcher, instance, cursor).run_requests == []

    # The warm start was trained once, by its own run; both members reused it.
    assert len(instance.fetch_materializations(AssetKey("sweep_warm_start"), limit=10).records) == 1
    assert len(list(factory_home.checkpoints.glob("sft-*.result.json"))) == 1
    for _, run in seen:
        logs = [e.message for e in instance.all_logs(run.run_id) if e.message]
        assert any(f"sft checkpoint {ws}: reused" in m for m in logs)
        tags = instance.get_run_by_id(run.run_id).tags
        assert tags["factory/progress"] == "grpo 2/2" and tags["factory/eta"] == "0s"  # the last progress report
        md = run.asset_materializations_for_node("sweep_member_run")[0].metadata
        assert md["curves"].value.startswith("![reward and accuracy by step of ")
        assert "/get-artifact?path=plots%2Fcurves.small.png&run_uuid=" in md["curves"].value
        assert len(md["curves"].value) < 1000  # short enough for the UI to draw in place
        assert md["mlflow_run_id"].value.startswith("http://127.0.0.1:5000/#/experiments/")
        assert md["pictures"].value.count("data:image/png;base64,") == 3  # curves, evals, metric panel: no MLflow UI
        assert "/get-artifact?path=plots%2Fmetrics.small.png&run_uuid=" in md["metrics"].value
        assert md["axes"].value.startswith("algorithm.lr=")
        assert md["label"].value.startswith("lr=") and tags["factory/label"] == md["label"].value  # axis values

    # 3. The summary comes as soon as the members have ended, naming the evals still owed (their final checkpoints
    # x 2 benchmarks); the evals then go one at a time (the eval limit), not held back by the summary (its own queue),
    # and the summary is drawn again once every eval has started and once they have all landed, saying none is pending.
    first = tick(sweep_summarizer, instance)
    (early,) = first.run_requests
    assert early.tags["factory/evals_pending"] == "4"
    assert len(tick(new_checkpoint_evals, instance).run_requests) == 1  # no eval slot is held for the summary
    early_md = execute(instance, early).asset_materializations_for_node("sweep_summary")[0].metadata
    assert early_md["pending_evals"].value.startswith("4: ") and early_md["pending_evals_count"].value == 4
    evaluated = 0
    while True:
        res = tick(new_checkpoint_evals, instance)
        if not res.run_requests:
            break
        assert len(res.run_requests) == 1  # never more than the limit at once
        for add in res.dynamic_partitions_requests:
            instance.add_dynamic_partitions(add.partitions_def_name, add.partition_keys)
        busy = create_run_for_test(instance, job_name="checkpoint_eval_job", status=DagsterRunStatus.STARTED,
                                   tags={**res.run_requests[0].tags,
                                         "dagster/partition": str(res.run_requests[0].partition_key)})
        between = tick(sweep_summarizer, instance, first.cursor).run_requests  # beside the last eval, not before
        assert [r.tags["factory/evals_pending"] for r in between] == (["1"] if evaluated == 3 else [])
        for r in between:
            execute(instance, r)
        instance.delete_run(busy.run_id)
        execute(instance, res.run_requests[0])
        evaluated += 1
    assert evaluated == 4  # 2 final checkpoints x (held-out split, carry_chains)

    # 4. The complete summary: members compared, with links, pictures and a tie reported as a tie.
    summary = tick(sweep_summarizer, instance, first.cursor)
    (req,) = summary.run_requests
    assert req.partition_key == sweep_id and req.tags["factory/queue"] == "summary"
    assert req.tags["factory/evals_pending"] == "0"
    assert tick(sweep_summarizer, instance, summary.cursor).run_requests == []
    md = execute(instance, req).asset_materializations_for_node("sweep_summary")[0].metadata
    assert md["pending_evals"].value == "none"
    lake = Lake.open(factory_home)
    rows = {r["member"]: r for r in lake.read("sweeps").to_pylist()}
    accs = [rows[k]["final_accuracy"] for k in keys]
    best = compare_sweep(lake, sweep_id).best  # the top member and those not significantly below it
    assert best[0] in [k for k in keys if rows[k]["final_accuracy"] == max(accs)]
    assert md["best_member"].value == (best[0] if len(best) == 1 else f"tie: {', '.join(best)}")
    assert " n=" in md["best_accuracy_ci95"].value  # `0.764 [0.725, 0.799] n=500`
    table = md["members_table"].value
    # the table ranks final results, names a member by its key's index part, its label beside it (wrapping between
    # axes), and gives how far it got and each figure with its interval and n, in few columns (a 1600 px page's)
    assert [c.name for c in table.schema.columns] == ["rank", "member", "status", "accuracy", "pass@2", "reward"]
    assert [r.data["rank"] for r in table.records] == list(range(1, len(keys) + 1))  # all succeeded: all ranked
    assert [r.data["member"] for r in table.records] == [
        f"{member_short(k)} {short_label(json.loads(rows[k]['axes'])).replace(',', ', ')}"
        for k in sorted(keys, key=lambda k: -rows[k]["final_accuracy"])]
    assert all(re.fullmatch(r"succeeded, 2 steps, \d+s", r.data["status"]) and r.data["accuracy"].endswith(" n=20")
               and re.fullmatch(r"\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] n=20", r.data["pass@2"])
               and r.data["reward"] is not None for r in table.records)
    links = md["links"].value
    assert all(f"\n| {member_short(k)} | " in links for k in keys)  # the member's m<index>, not a piece of its key
    assert all(f"(/runs/{run.run_id})" in links for _, run in seen)
    # checkpoints by their path under FACTORY_HOME (a home's path does not wrap in the value column)
    assert links.count("http://127.0.0.1:5000/#/experiments/") == 2 and links.count("`checkpoints/") == 2
    assert links.count("?workflowType=machine_learning") == 2  # MLflow's training view, not its GenAI one
    charts = md["mlflow_members_charts"].value  # the members flat in MLflow's chart view (tracking.sweep_url)
    assert "compareRunsMode=CHART" in charts and f"%27{sweep_id}%27" in charts
    names = ("members_on_heldout", "members_on_carry_chains", "accuracy_vs_lr")  # an axis by its last name
    for name in names:
        assert "/get-artifact?" in md[name].value and len(md[name].value) < 1000
        assert f"**{name}**" in md["pictures"].value
    assert md["pictures"].value.count("data:image/png;base64,") == 3
    parent = rows[keys[0]]["mlflow_parent_run_id"]
    client = Tracker(factory_home).client
    assert {a.path for a in client.list_artifacts(parent, "plots")} == {
        f"plots/{n}{size}.png" for n in names for size in ("", ".small")}
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 2
    assert {a.path for c in children for a in client.list_artifacts(c.info.run_id, "plots")} == {
        f"plots/{n}{size}.png" for n in ("curves", "evals", "metrics") for size in ("", ".small")}


@pytest.mark.slow
def test_summary_reports_a_tie_as_a_tie(instance, factory_home):
    from datetime import UTC, datetime

    from dagster import materialize

    from assets.sweeps import sweep_summary

    lake = Lake.open(factory_home)
    now = datetime.now(UTC)
    lake.upsert("sweeps", [dict(sweep_id="s", member=f"s-m00{i}", name="s", axes=json.dumps({"seed": i}), spec="{}",
                                status="succeeded", final_accuracy=0.5, created_at=now, recorded_at=now)
                           for i in range(2)] + [dict(sweep_id="s", member="s-m002", name="s",
                                                      axes=json.dumps({"seed": 2}), spec="{}", status="failed",
                                                      created_at=now, recorded_at=now)])
    instance.add_dynamic_partitions(sweeps.name, ["s"])
    md = materialize([sweep_summary], partition_key="s", instance=instance,
                     resources=defs.resources).asset_materializations_for_node("sweep_summary")[0].metadata
    assert md["best_member"].value == "tie: s-m000, s-m001" and md["best_accuracy"].value == 0.5
    assert md["failed"].value == 1


@pytest.mark.slow
def test_one_member_failing_does_not_affect_the_others(instance, factory_home):
    """A member whose rewards overflow float32 (its losses go non-finite and the run stops) fails alone: the other
    member trains to the end, both were launched at once, and the sweep's rows say which failed."""
    daemon_running(instance)
    envs = ["tests.ops.faulty_envs:plain_reward", "tests.ops.faulty_envs:overflowing_reward"]
    result = launch(instance, axes={"task.environment": envs},
                    max_concurrent=2,
                    overrides=[*TINY, "schedule.steps=3", "ops.max_nonfinite_steps=1"])
    assert result.success
    out = result.output_for_node("plan_and_queue_sweep")
    first = tick(sweep_launcher, instance)
    for ws in first.run_requests:  # a warm start per task (the environment is part of it)
        execute(instance, ws)
    members = tick(sweep_launcher, instance, first.cursor).run_requests
    assert len(members) == 2  # both at once: max_concurrent 2
    runs = {}
    for req in members:
        runs[req.tags["axis/task.environment"]] = defs.resolve_job_def("sweep_member_job").execute_in_process(
            instance=instance, partition_key=req.partition_key, tags=req.tags, raise_on_error=False)
    good, bad = runs[envs[0]], runs[envs[1]]
    assert good.success and not bad.success
    assert "NonFiniteLoss" in _failure(bad)
    assert not [e for e in bad.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]  # needs a fix: no retry
    rows = {r["member"]: r for r in Lake.open(factory_home).read("sweeps").to_pylist()}
    assert sorted(r["status"] for r in rows.values()) == ["failed", "succeeded"]
    runs_rows = {r["run_id"]: r for r in Lake.open(factory_home).read("runs").to_pylist()}
    good_row = rows[next(k for k in out["members"] if rows[k]["status"] == "succeeded")]
    assert runs_rows[good_row["run_id"]]["status"] == "succeeded"
