"""The quickstart asset graph materialized for real (tiny spec) in a temp FACTORY_HOME.

Checks what a user would look at afterwards: Iceberg rows, the MLflow run, the checkpoint.
"""

from pathlib import Path

import pytest
from dagster import DagsterInstance, materialize
from transformers import AutoModelForCausalLM

from factory.cockpit.tracking import Tracker
from factory.digest import dir_digest
from factory.lake import Lake, query
from jobs import ALL_CHECKS, QUICKSTART_ASSETS, defs, make_resources

TINY = [
    "name=itest", "model.preset=micro", "task.n_train=300", "task.n_eval=40", "sft.steps=20",
    "sft.stop_at_accuracy=null", "rollout.prompts_per_step=4", "algorithm.group_size=4",
    "schedule.steps=3", "schedule.eval_pass_k=2",
]
SPEC = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")


@pytest.fixture(scope="module")
def materialized(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    with DagsterInstance.ephemeral() as instance:
        result = materialize([*QUICKSTART_ASSETS, *ALL_CHECKS], resources=make_resources(SPEC, TINY, str(home)),
                             instance=instance)
        assert result.success
        yield result, home, instance.get_run_by_id(result.run_id).tags


def test_definitions_load():
    assert defs.resolve_job_def("quickstart") is not None
    assert {k.to_user_string() for k in defs.resolve_all_asset_keys()} == {
        "task_dataset", "sft_checkpoint", "grpo_run", "sft_control", "eval_report", "sweep_warm_start",
        "sweep_member_run", "sweep_summary", "checkpoint_eval", "node_health", "source_arithmetic", "blend",
        "prompt_stats"}


@pytest.mark.slow
def test_iceberg_records(materialized):
    result, home, _ = materialized
    md = result.asset_materializations_for_node("grpo_run")[0].metadata
    run_id = md["run_id"].value
    # the pictures: drawn in place (a short image link the MLflow UI serves), and embedded one click away
    assert len(md["curves"].value) < 1000 and len(md["evals"].value) < 1000 and len(md["metrics"].value) < 1000
    assert md["pictures"].value.count("data:image/png;base64,") == 3  # curves, evals, the metric panel
    from factory.home import factory_home

    lake = Lake.open(factory_home(home))
    runs = lake.read("runs").to_pylist()
    assert [(r["run_id"], r["status"]) for r in runs] == [(run_id, "succeeded")]
    steps = query(f"SELECT step, weight_version, reward_mean, logprob_mismatch FROM steps "
                  f"WHERE run_id = '{run_id}' ORDER BY step", lake).to_pylist()
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["logprob_mismatch"] < 1e-3 for s in steps)
    evals = query(f"SELECT step, value FROM evals WHERE run_id = '{run_id}' AND metric = 'accuracy' "
                  f"AND benchmark = 'arithmetic_heldout' ORDER BY step", lake).to_pylist()
    assert [e["step"] for e in evals] == [0, 3]
    rollouts = query(f"SELECT step, count(*) AS n, count(DISTINCT prompt_id) AS groups FROM rollouts "
                     f"WHERE run_id = '{run_id}' GROUP BY step ORDER BY step", lake).to_pylist()
    assert rollouts == [{"step": s, "n": 8, "groups": 2} for s in (1, 2, 3)]  # log_rollouts=2 groups of 4
    (ckpt,) = [c for c in lake.read("checkpoints").to_pylist() if c["run_id"] == run_id]
    assert ckpt["step"] == 3 and dir_digest(Path(ckpt["uri"])) == (ckpt["sha256"], ckpt["bytes"])
    assert AutoModelForCausalLM.from_pretrained(ckpt["uri"]).config.model_type == "qwen2"


@pytest.mark.slow
def test_progress_was_shown_on_the_run(materialized):
    _, _, tags = materialized
    # the last report of each stage that ran: the run's tags end with GRPO's final step
    assert tags["factory/progress"] == "grpo 3/3" and tags["factory/eta"] == "0s" and "factory/reward" in tags


@pytest.mark.slow
def test_mlflow_run(materialized):
    result, home, _ = materialized
    md = result.asset_materializations_for_node("grpo_run")[0].metadata
    from factory.home import factory_home

    tracker = Tracker(factory_home(home))
    link = md["mlflow_run_id"].value  # a link into MLflow's training view of the run
    run_id, _, view = link.rpartition("/runs/")[2].partition("?")
    run = tracker.get_run(run_id)
    assert view == "workflowType=machine_learning"
    assert run.info.status == "FINISHED"
    assert run.data.tags["factory.run_id"] == md["run_id"].value
    assert run.data.params["algorithm.group_size"] == "4"
    assert [s for s, _ in tracker.metric_history(run.info.run_id, "batch/reward_mean")] == [1, 2, 3]


@pytest.mark.slow
def test_report_and_check(materialized):
    result, _, _ = materialized
    report = result.asset_materializations_for_node("eval_report")[0].metadata
    assert "held-out accuracy" in report["report"].value
    (check,) = result.get_asset_check_evaluations()
    assert check.check_name == "grpo_beats_sft"
    gain = check.metadata["gain"].value
    assert check.passed == (gain > 0)
    # figures shown as what they mean: accuracies and their difference to 3 decimals, not 0.020000000000000018
    for value in (gain, *(report[k].value for k in ("sft_accuracy", "grpo_accuracy", "gain") if k in report)):
        assert value == round(value, 3)


@pytest.mark.slow
def test_rematerializing_unchanged_inputs_reuses_the_sft_checkpoint(materialized):
    result, home, _ = materialized
    first = result.asset_materializations_for_node("sft_checkpoint")[0]
    with DagsterInstance.ephemeral() as instance:
        again = materialize(QUICKSTART_ASSETS[:2], resources=make_resources(SPEC, TINY, str(home)),
                            instance=instance)
    second = again.asset_materializations_for_node("sft_checkpoint")[0]
    # same checkpoint, same data version (nothing downstream goes stale), and no second training run
    assert second.metadata["sha256"] == first.metadata["sha256"]
    assert second.tags["dagster/data_version"] == first.tags["dagster/data_version"]
    assert second.metadata["seconds"] == first.metadata["seconds"]  # the recorded training time, not a new one
