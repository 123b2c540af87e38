"""The sweep job, its sensors and a member run, with real Dagster materializations in a temp instance."""

import json
from pathlib import Path

import pytest
from dagster import DagsterInstance, build_sensor_context, materialize

from assets.sweeps import sweep_member_run, sweep_members, sweep_summary, sweeps
from factory.home import factory_home
from factory.lake import Lake
from factory.tracking import Tracker
from jobs.sweeps import sweep, sweep_launcher, sweep_summarizer
from resources import FactoryHomeResource, LakeResource, MlflowResource

BASE = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=2", "schedule.eval_pass_k=2"]


def resources(home: Path) -> dict:
    h = FactoryHomeResource(root=str(home))
    return {"home": h, "lake": LakeResource(home=h), "mlflow": MlflowResource(home=h)}


def launch(instance, home, **config):
    cfg = {"name": "t", "base_spec": BASE, "overrides": TINY, **config}
    return sweep.execute_in_process(run_config={"ops": {"plan_and_queue_sweep": {"config": cfg}}},
                                    instance=instance, resources=resources(home), raise_on_error=False)


@pytest.fixture
def instance():
    with DagsterInstance.ephemeral() as inst:
        yield inst


def test_a_bad_axis_fails_naming_it_and_launches_nothing(instance, tmp_path):
    result = launch(instance, tmp_path, axes={"algorithm.lr": [1e-5], "algorithm.grup_size": [4, 8]})
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "axes.algorithm.grup_size = 4: algorithm.grup_size: unknown key" in str(failure.event_specific_data.error)
    assert instance.get_dynamic_partitions(sweep_members.name) == []
    assert not (tmp_path / "sweeps").exists()
    assert Lake.open(factory_home(tmp_path)).read("sweeps").num_rows == 0
    ctx = build_sensor_context(instance=instance, resources={"home": FactoryHomeResource(root=str(tmp_path))})
    assert sweep_launcher(ctx).run_requests == []


def test_sweep_queues_members_and_they_train_nested_under_the_parent(instance, tmp_path):
    result = launch(instance, tmp_path, axes={"algorithm.lr": [1e-3, 3e-3]}, max_concurrent=1)
    assert result.success
    out = result.output_for_node("plan_and_queue_sweep")
    sweep_id, keys = out["sweep_id"], out["members"]
    assert instance.get_dynamic_partitions(sweep_members.name) == keys and len(keys) == 2
    assert instance.get_dynamic_partitions(sweeps.name) == [sweep_id]
    lake = Lake.open(factory_home(tmp_path))
    assert sorted(r["status"] for r in lake.read("sweeps").to_pylist()) == ["queued", "queued"]

    home = FactoryHomeResource(root=str(tmp_path))
    ctx = build_sensor_context(instance=instance, resources={"home": home})
    res = sweep_launcher(ctx)
    assert [r.partition_key for r in res.run_requests] == keys
    assert [r.run_key for r in res.run_requests] == keys  # never launched twice
    assert {r.tags["factory/sweep_id"] for r in res.run_requests} == {sweep_id}
    assert len({r.tags["factory/lane"] for r in res.run_requests}) == 1  # max_concurrent 1: one lane
    again = sweep_launcher(build_sensor_context(instance=instance, resources={"home": home}, cursor=res.cursor))
    assert again.run_requests == []

    def summarize(cursor=None):
        with build_sensor_context(instance=instance, resources=resources(tmp_path), cursor=cursor) as ctx:
            return sweep_summarizer(ctx)

    assert summarize().run_requests == []  # members not done yet

    for key in keys:
        r = materialize([sweep_member_run], partition_key=key, instance=instance, resources=resources(tmp_path))
        assert r.success
        md = r.asset_materializations_for_node("sweep_member_run")[0].metadata
        curves = md["curves"].value
        assert curves.startswith("![reward and accuracy of ") and "data:image/png;base64," in curves
    rows = {r["member"]: r for r in lake.read("sweeps").to_pylist()}
    assert [rows[k]["status"] for k in keys] == ["succeeded", "succeeded"]
    assert all(rows[k]["final_accuracy"] is not None and rows[k]["run_id"] for k in keys)
    runs = {r["run_id"]: r for r in lake.read("runs").to_pylist()}
    assert {runs[rows[k]["run_id"]]["sweep_id"] for k in keys} == {sweep_id}
    assert [json.loads(runs[rows[k]["run_id"]]["spec"])["algorithm"]["lr"] for k in keys] == [1e-3, 3e-3]
    # MLflow: a parent run with both members nested under it
    parent = rows[keys[0]]["mlflow_parent_run_id"]
    client = Tracker(factory_home(tmp_path)).client
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 2
    # the SFT warm start was trained once and shared (same model/task/SFT settings)
    assert len(list((tmp_path / "checkpoints").glob("sft-*.result.json"))) == 1

    done = summarize()
    assert [r.partition_key for r in done.run_requests] == [sweep_id]
    assert summarize(done.cursor).run_requests == []
    s = materialize([sweep_summary], partition_key=sweep_id, instance=instance, resources=resources(tmp_path))
    md = s.asset_materializations_for_node("sweep_summary")[0].metadata
    assert md["members"].value == 2 and md["succeeded"].value == 2 and md["best_member"].value in keys
    assert "data:image/png;base64," in md["accuracy_vs_algorithm.lr"].value
    artifacts = [a.path for a in client.list_artifacts(parent, "plots")]
    assert artifacts == ["plots/accuracy_vs_algorithm.lr.png"]
    child_artifacts = {a.path for c in children for a in client.list_artifacts(c.info.run_id, "plots")}
    assert child_artifacts == {"plots/curves.png"}
