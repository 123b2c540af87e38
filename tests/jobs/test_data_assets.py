"""Data assets in real Dagster runs over a temp FACTORY_HOME: source assets (generated ones materialized, a
Parquet file observed), the blend's data version, prompt_stats, and the lineage into training and evals."""

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from dagster import (
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
    Definitions,
    evaluate_automation_conditions,
    materialize,
)

from assets.data import data_assets, prompt_stats, source_key, spec_source_assets, stopped_teaching
from assets.datasets import task_dataset
from factory.config import load_spec
from jobs import make_resources
from jobs.data import blend_job

QUICKSTART = Path(__file__).parents[2] / "examples" / "quickstart.yaml"


def write_parquet(path: Path, answers: list[str]) -> Path:
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(len(answers))],
                             "prompt": [f"{i}+{i}=" for i in range(len(answers))], "answer": answers}), path)
    return path


def write_spec(tmp_path: Path, parquet: Path) -> Path:
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["schedule"]["steps"] = 12
    spec["rollout"]["prompts_per_step"] = 8
    spec["data"] = {
        "sources": [{"name": "add2", "kind": "arithmetic", "op": "add", "digits": 2, "n": 400},
                    {"name": "add3", "kind": "arithmetic", "op": "add", "digits": 3, "n": 400, "seed": 1},
                    {"name": "pq", "kind": "parquet", "path": str(parquet), "verifier": "arithmetic"}],
        "weights": {"add2": 0.5, "add3": 0.25, "pq": 0.25}}
    path = tmp_path / "blend.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def instance(factory_home):
    with DagsterInstance.ephemeral() as inst:
        yield inst


def versions(instance) -> dict[str, str]:
    out = {}
    for key in ("source_add2", "source_add3", "source_pq", "blend"):
        rec = instance.get_latest_data_version_record(AssetKey(key))
        out[key] = rec.asset_materialization.tags["dagster/data_version"] if rec.asset_materialization else \
            rec.asset_observation.tags["dagster/data_version"]
    return out


@pytest.mark.slow
def test_data_versions_follow_the_file_and_the_weights(tmp_path, factory_home, instance):
    parquet = write_parquet(tmp_path / "p.parquet", [str(2 * i) for i in range(60)])
    spec_path = write_spec(tmp_path, parquet)
    assets = data_assets(load_spec(spec_path))
    resources = make_resources(str(spec_path), [], str(factory_home.root))
    job = Definitions(assets=assets, jobs=[blend_job(assets)], resources=resources).resolve_job_def("blend_job")

    def refresh() -> dict[str, str]:
        result = job.execute_in_process(instance=instance)
        assert result.success
        kinds = {e.asset_key.to_user_string(): e.event_type_value for e in result.all_events if e.asset_key}
        assert kinds["source_pq"] == "ASSET_OBSERVATION" and kinds["source_add2"] == "ASSET_MATERIALIZATION"
        return versions(instance)

    first = refresh()
    assert len(set(first.values())) == 4
    assert refresh() == first  # same inputs: same versions

    md = instance.get_latest_materialization_event(AssetKey("blend")).asset_materialization.metadata
    assert md["blend_version"].value == first["blend"]
    table = {r.data["source"]: r.data for r in md["sources"].value.records}
    assert {s: table[s]["target_share"] for s in table} == {"add2": 0.5, "add3": 0.25, "pq": 0.25}
    assert table["add2"]["draws"] == 48 and table["pq"]["rows"] == 60  # 96 draws split exactly
    assert 0 <= md["max_quota_error"].value < 1
    assert len(md["shares"].value) < 1000 and "get-artifact?path=plots%2Fshares.small.png" in md["shares"].value
    assert md["pictures"].value.count("data:image/png;base64,") == 1
    # Dagster recorded which version of the observed file the blend was built from
    inputs = instance.get_latest_materialization_event(AssetKey("blend")).asset_materialization.tags
    assert inputs["dagster/input_data_version/source_pq"] == first["source_pq"]

    write_parquet(parquet, [str(2 * i) for i in range(59)] + ["999"])  # one answer changed
    changed = refresh()
    assert changed["source_pq"] != first["source_pq"] and changed["blend"] != first["blend"]
    assert (changed["source_add2"], changed["source_add3"]) == (first["source_add2"], first["source_add3"])

    # materialize() (which runs materializations only) with other weights: a new blend version; back: the old one
    generated = [a for a in assets if a.key != AssetKey("blend") and a.is_materializable]
    blend = next(a for a in assets if a.key == AssetKey("blend"))
    heavier = make_resources(str(spec_path), ["data.weights.add2=2.0"], str(factory_home.root))
    assert materialize([*generated, blend], instance=instance, resources=heavier).success
    reweighted = versions(instance)
    assert reweighted["blend"] not in (first["blend"], changed["blend"])
    assert reweighted["source_add2"] == first["source_add2"]
    assert materialize([blend], instance=instance, resources=resources).success
    assert versions(instance)["blend"] == changed["blend"]


def test_a_blend_with_another_spec_than_the_graph_is_refused_by_name(tmp_path, factory_home, instance):
    spec_path = write_spec(tmp_path, write_parquet(tmp_path / "p.parquet", ["0", "2"]))
    assets = data_assets(load_spec(QUICKSTART))  # built for the quickstart: one source, the task's split
    blend = next(a for a in assets if a.key == AssetKey("blend"))
    # with the task's dataset, its input in that graph: the blend is refused for its sources, not for a missing input
    result = materialize([task_dataset, blend], instance=instance,
                         resources=make_resources(str(spec_path), [], str(factory_home.root)), raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "the spec's sources ['add2', 'add3', 'pq'] are not the ones this code location's source assets were " \
           "built from ['arithmetic']" in failure.event_specific_data.error.message


def test_source_assets_of_a_spec_and_a_missing_file_named(tmp_path, factory_home, instance):
    spec_path = write_spec(tmp_path, write_parquet(tmp_path / "p.parquet", ["0"]))
    spec = load_spec(spec_path)
    keys = sorted(k.to_user_string() for a in spec_source_assets(spec) for k in a.keys)
    assert keys == ["source_add2", "source_add3", "source_pq"]
    assert source_key("gsm8k.v1-main") == "source_gsm8k_v1_main"
    (tmp_path / "p.parquet").unlink()
    assets = data_assets(spec)
    job = Definitions(assets=assets, jobs=[blend_job(assets)],
                      resources=make_resources(str(spec_path), [], str(factory_home.root))).resolve_job_def("blend_job")
    result = job.execute_in_process(instance=instance, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "source 'pq' could not be observed" in failure.event_specific_data.user_failure_data.description


def test_lineage_from_source_to_blend_to_training_to_evals_and_stats():
    from jobs import defs

    graph = defs.resolve_asset_graph()

    def parents(key: str) -> set[str]:
        return {k.to_user_string() for k in graph.get(AssetKey(key)).parent_keys}

    assert parents("source_arithmetic") == {"task_dataset"}  # the quickstart: one source, the task's split
    assert parents("blend") == {"source_arithmetic", "task_dataset"}
    assert "blend" in parents("grpo_run")
    assert "grpo_run" in parents("checkpoint_eval")  # the checkpoint a run records is evaluated downstream
    assert parents("prompt_stats") == {"grpo_run"}
    down = {k.to_user_string() for k in graph.get(AssetKey("source_arithmetic")).child_keys}
    assert down == {"blend"}
    assert {"source_arithmetic", "blend", "prompt_stats"} <= {
        k.to_user_string() for k in defs.resolve_job_def("quickstart").asset_layer.selected_asset_keys}
    assert graph.get(AssetKey("blend")).group_name == graph.get(AssetKey("prompt_stats")).group_name == "data"


def _attempts(lake, run_id: str, rows: list[tuple[str, str, int, int]]) -> None:
    now = datetime.now(UTC)
    lake.upsert("runs", [dict(run_id=run_id, name="t", spec="{}", spec_fingerprint="f", code_version="c",
                              status="succeeded", seed=0, started_at=now)])
    lake.upsert("prompt_attempts", [dict(run_id=run_id, draw=i, step=i, source=s, prompt_id=p, samples=n, passes=k,
                                         reward_mean=k / n, reward_std=0.0, recorded_at=now)
                                    for i, (s, p, n, k) in enumerate(rows)])


def test_prompt_stats_asset_refreshes_after_a_run_and_counts_prompts_that_stopped_teaching(lake, factory_home,
                                                                                          instance):
    # the eager condition: a new grpo_run materialization requests prompt_stats (evaluated as the sensor would)
    from jobs import defs

    before = evaluate_automation_conditions(defs=defs, instance=instance)
    assert before.total_requested == 0  # no run yet: nothing to count
    instance.report_runless_asset_event(AssetMaterialization("grpo_run"))
    after = evaluate_automation_conditions(defs=defs, instance=instance, cursor=before.cursor)
    assert after.total_requested == 1 and after.get_num_requested(AssetKey("prompt_stats")) == 1

    _attempts(lake, "r1", [("add2", "a", 8, 8), ("add2", "b", 8, 3), ("add3", "c", 8, 0), ("add3", "d", 4, 0)])
    resources = make_resources(str(QUICKSTART), [], str(factory_home.root))
    md = materialize([prompt_stats], instance=instance, resources=resources).asset_materializations_for_node(
        "prompt_stats")[0].metadata
    assert md["rows"].value == 4 and md["rows_changed"].value == 4
    assert md["stopped_teaching"].value == 2  # a (all right) and c (all wrong); d has too few samples (4 < 8)
    assert md["prompts_by_source"].value == {"add2": 2, "add3": 2}
    snap = md["snapshot_id"].value
    again = materialize([prompt_stats], instance=instance, resources=resources).asset_materializations_for_node(
        "prompt_stats")[0].metadata
    assert again["rows_changed"].value == 0 and again["snapshot_id"].value == snap  # nothing new: same snapshot
    assert stopped_teaching([{"attempts": 8, "passes": 4}], 8) == 0
