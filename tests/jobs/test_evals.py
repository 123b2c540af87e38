"""Periodic evals: the new-checkpoint sensor within the eval limit, the retrying schedule, the regression check
per checkpoint x benchmark, and the lineage from training to evals, with real checkpoints, real evaluations and
real Dagster materializations in a temp instance."""

import asyncio
from datetime import UTC, datetime

import pytest
from dagster import (
    AssetCheckKey,
    AssetKey,
    DagsterRunStatus,
    build_schedule_context,
    build_sensor_context,
    instance_for_test,
    materialize,
)
from dagster._core.loader import LoadingContextForTest
from dagster._core.test_utils import create_run_for_test

from assets.evals import checkpoint_eval, checkpoint_evals
from factory.cockpit.tracking import Tracker
from factory.config import parse_spec
from factory.lake import Lake
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer
from factory.runs.checkpoint_eval import checkpoint_key, eval_key, parse_checkpoint_key, parse_eval_key
from factory.runs.eval_server import stop_server
from factory.runs.rl_run import run_rl
from factory.runs.stages import build_dataset, load_dataset, train_sft_checkpoint
from jobs.evals import eval_schedule, new_checkpoint_evals
from resources import FactoryHomeResource, LakeResource, MlflowResource

# Two-digit additions written least-significant digit first: a micro model learns some in 600 SFT steps.
SPEC = {"seed": 0, "name": "evals", "model": {"preset": "micro"},
        "task": {"digits": [2], "operations": ["add"], "n_train": 2000, "n_eval": 60, "reverse_answer": True,
                 "reverse_operands": True},
        "sft": {"steps": 600, "stop_at_accuracy": None, "lr": 3e-3},
        "algorithm": {"lr": 1e-7, "group_size": 4},  # RL that barely moves: consecutive checkpoints agree
        "rollout": {"max_new_tokens": 4, "prompts_per_step": 4},
        "schedule": {"steps": 2, "checkpoint_every": 1, "eval_every": 1, "eval_pass_k": 2}}


def resources(home) -> dict:
    h = FactoryHomeResource(root=str(home.root))
    return {"home": h, "lake": LakeResource(home=h), "mlflow": MlflowResource(home=h)}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A run with checkpoints at steps 1 and 2, then a deliberately worse one (untrained weights) at step 3."""
    from factory.home import factory_home

    home = factory_home(tmp_path_factory.mktemp("home"))
    spec = parse_spec(SPEC)
    splits = load_dataset(build_dataset(spec, home).path)
    sft = train_sft_checkpoint(spec, home, splits, log=lambda _: None)
    assert sft.accuracy >= 0.1, sft.accuracy  # something to lose
    lake = Lake.open(home)
    run = run_rl(spec, home, sft.checkpoint.path, splits, lake, Tracker(home), log=lambda _: None)
    tok = build_tokenizer()
    bad = save_checkpoint(build_model("micro", tok, seed=1), tok, home.checkpoints / run.run_id / "step-000003")
    lake.upsert("checkpoints", [dict(run_id=run.run_id, step=3, kind="rl", uri=str(bad.path), bytes=bad.bytes,
                                     sha256=bad.sha256, recorded_at=datetime.now(UTC))])
    yield home, run.run_id
    assert stop_server(home) is not None  # the materializations below evaluated through the home's eval server


def test_checkpoint_keys_round_trip():
    assert parse_checkpoint_key(checkpoint_key("a-b@c-1", 12)) == ("a-b@c-1", 12)
    with pytest.raises(ValueError, match="not a checkpoint key"):
        parse_checkpoint_key("run-without-step")
    # an eval's key is the string of the checkpoint x benchmark key it replaced: materializations before still count
    from dagster import MultiPartitionKey

    assert eval_key("a-b@c-1@12", "carry_chains") == str(
        MultiPartitionKey({"checkpoint": "a-b@c-1@12", "benchmark": "carry_chains"}))
    assert parse_eval_key(eval_key("a-b@c-1@12", "heldout")) == ("a-b@c-1@12", "heldout")
    with pytest.raises(ValueError, match="not an eval key"):
        parse_eval_key("mmlu|a@1")


def _sensor(instance, home):
    with build_sensor_context(instance=instance, resources=resources(home)) as ctx:
        return new_checkpoint_evals(ctx)


@pytest.mark.slow
def test_the_sensor_spreads_evals_within_the_limit(recorded):
    home, run_id = recorded
    keys = [checkpoint_key(run_id, s) for s in (1, 2, 3)]
    with instance_for_test() as instance:
        first = _sensor(instance, home)
        # every checkpoint's evals registered at once, each only on its task's benchmarks (no humaneval partition of
        # an arithmetic checkpoint, which could never materialize)...
        assert first.dynamic_partitions_requests[0].partition_keys == [
            eval_key(k, b) for k in keys for b in ("heldout", "carry_chains")]
        (req,) = first.run_requests  # ...but one eval at a time (the default limit): the oldest checkpoint first
        assert req.partition_key == eval_key(keys[0], "heldout")
        assert req.tags["factory/queue"] == "eval"
        instance.add_dynamic_partitions(checkpoint_evals.name, first.dynamic_partitions_requests[0].partition_keys)
        assert _sensor(instance, home).dynamic_partitions_requests == []  # registered once
        busy = create_run_for_test(instance, job_name="checkpoint_eval_job", status=DagsterRunStatus.STARTED,
                                   tags={**req.tags, "dagster/partition": str(req.partition_key)})
        assert _sensor(instance, home).run_requests == []  # the slot is taken
        instance.report_run_canceled(busy)
        nxt = _sensor(instance, home).run_requests  # the canceled one is not relaunched by the sensor...
        assert [r.partition_key for r in nxt] == [eval_key(keys[0], "carry_chains")]
        with build_schedule_context(instance=instance, resources=resources(home)) as ctx:
            retry = eval_schedule(ctx)  # ...the schedule retries it
        assert [str(r.partition_key) for r in retry] == [str(req.partition_key)]

    # An operator's limit in dagster.yaml: three at once.
    limits = {"concurrency": {"runs": {"tag_concurrency_limits": [
        {"key": "factory/queue", "value": "eval", "limit": 3}]}}}
    with instance_for_test(overrides=limits) as instance:
        assert len(_sensor(instance, home).run_requests) == 3


@pytest.mark.slow
def test_regression_check_per_checkpoint_and_benchmark(recorded):
    home, run_id = recorded
    keys = [checkpoint_key(run_id, s) for s in (1, 2, 3)]
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(checkpoint_evals.name, [eval_key(k, b) for k in keys
                                                                for b in ("heldout", "carry_chains")])
        checks = {}
        for k in keys:
            pk = eval_key(k, "heldout")
            r = materialize([checkpoint_eval], partition_key=pk, instance=instance, resources=resources(home),
                            run_config={"ops": {"checkpoint_eval": {"config": {"regression_tolerance": 0.05}}}})
            assert r.success  # a failed check does not fail the run; it is recorded on the asset
            (ev,) = r.get_asset_check_evaluations()
            checks[parse_checkpoint_key(k)[1]] = ev
            md = r.asset_materializations_for_node("checkpoint_eval")[0].metadata
            assert md["step"].value == str(parse_checkpoint_key(k)[1])  # text: not plotted across partitions
        assert checks[1].passed
        assert checks[1].metadata["compared_with"].value.startswith("nothing: the run's first evaluated checkpoint")
        assert "previous_step" not in checks[1].metadata  # no -1 plotted as if it were a step
        assert checks[2].passed and checks[2].metadata["compared_with"].value.startswith("step 1 of the same run")
        assert not checks[3].passed  # the untrained weights lost what SFT taught
        assert float(checks[3].metadata["drop"].value) > 0.05
        # Every figure of the check is text: Dagster plots numeric check metadata across every execution, which
        # joined runs and benchmarks in wall-clock order. The picture is of this run and benchmark only.
        assert all(v.__class__.__name__ != "FloatMetadataValue" and v.__class__.__name__ != "IntMetadataValue"
                   for ev in checks.values() for v in ev.metadata.values())
        assert "data:image/png;base64," in checks[3].metadata["accuracy_by_step"].value

        # The check is partitioned like the asset: each execution belongs to its checkpoint x benchmark, so the
        # UI compares it with that partition's latest materialization (an unpartitioned check was compared with
        # whichever partition materialized last and showed "Not evaluated").
        key = AssetCheckKey(AssetKey("checkpoint_eval"), "no_regression")
        history = instance.event_log_storage.get_asset_check_execution_history(key, limit=10)
        assert sorted(r.partition for r in history) == sorted(eval_key(k, "heldout") for k in keys)
        ctx = LoadingContextForTest(instance)
        assert all(asyncio.run(r.targets_latest_materialization(ctx)) for r in history)

        lake = Lake.open(home)
        acc = {r["step"]: r["value"] for r in lake.read("evals").to_pylist()
               if r["run_id"] == run_id and r["benchmark"] == "arithmetic_heldout" and r["metric"] == "accuracy"}
        assert acc[3] < acc[2] - 0.05

        # the sensor: only what is still owed (the other benchmark), one at a time
        (todo,) = _sensor(instance, home).run_requests
        assert todo.partition_key == eval_key(keys[0], "carry_chains")
        assert materialize([checkpoint_eval], partition_key=todo.partition_key, instance=instance,
                           resources=resources(home)).success
        (carry,) = [r for r in lake.read("evals").to_pylist() if r["benchmark"] == "carry_chains"
                    and r["metric"] == "accuracy"]
        # ...and on the run's MLflow curves beside its held-out evals (carry_chains never reached MLflow)
        (mlflow_run_id,) = [r["mlflow_run_id"] for r in lake.read("runs").to_pylist() if r["run_id"] == run_id]
        tracker = Tracker(home)
        assert tracker.metric_history(mlflow_run_id, "eval/carry_chains") == [(1, carry["value"])]
        assert [s for s, _ in tracker.metric_history(mlflow_run_id, "eval/carry_chains/pass_at_2")] == [1]
        with build_schedule_context(instance=instance, resources=resources(home)) as ctx:
            assert len(eval_schedule(ctx)) == 1  # one slot


@pytest.mark.slow
def test_the_final_checkpoint_reuses_the_runs_own_held_out_result(recorded):
    home, run_id = recorded
    from factory.runs.checkpoint_eval import evaluate_recorded_checkpoint

    lake = Lake.open(home)
    final = max(r["step"] for r in lake.read("checkpoints").to_pylist() if r["run_id"] == run_id and r["step"] < 3)
    res = evaluate_recorded_checkpoint(home, lake, run_id, final, "heldout")
    recorded_acc = [r["value"] for r in lake.read("evals").to_pylist() if r["run_id"] == run_id and r["step"] == final
                    and r["benchmark"] == "arithmetic_heldout" and r["metric"] == "accuracy"]
    assert res.reused and [res.accuracy] == recorded_acc
    assert not evaluate_recorded_checkpoint(home, lake, run_id, final, "carry_chains").reused  # no row to reuse


@pytest.mark.slow
def test_a_mid_run_checkpoint_reuses_the_held_out_eval_the_run_made_at_its_step(recorded):
    """Step 1 is both a checkpoint and a periodic eval (eval_every 1): the run measured those weights on held-out
    already, so the checkpoint's eval reads that result instead of evaluating them again."""
    home, run_id = recorded
    from factory.runs.checkpoint_eval import evaluate_recorded_checkpoint

    lake = Lake.open(home)
    (ckpt,) = [r for r in lake.read("checkpoints").to_pylist() if r["run_id"] == run_id and r["step"] == 1]
    (periodic,) = [r for r in lake.read("evals").to_pylist() if r["run_id"] == run_id and r["step"] == 1
                   and r["benchmark"] == "arithmetic_heldout" and r["metric"] == "accuracy"]
    assert periodic["checkpoint_sha256"] == ckpt["sha256"]  # the periodic eval names the checkpoint it measured
    res = evaluate_recorded_checkpoint(home, lake, run_id, 1, "heldout")
    assert res.reused and res.accuracy == periodic["value"] and res.n == periodic["n"]


def test_lineage_connects_training_to_evals_and_members_to_the_summary():
    from jobs import defs

    graph = defs.resolve_asset_graph()
    parents = lambda key: {k.to_user_string() for k in graph.get(AssetKey(key)).parent_keys}  # noqa: E731
    assert {"grpo_run", "sweep_member_run"} <= parents("checkpoint_eval")
    assert "sweep_member_run" in parents("sweep_summary")
    assert "sweep_warm_start" in parents("sweep_member_run")


@pytest.mark.slow
def test_a_checkpoint_whose_files_changed_is_not_evaluated(recorded, tmp_path):
    home, run_id = recorded
    from factory.runs.checkpoint_eval import evaluate_recorded_checkpoint

    lake = Lake.open(home)
    (row,) = [r for r in lake.read("checkpoints").to_pylist() if r["run_id"] == run_id and r["step"] == 3]
    lake.upsert("checkpoints", [dict(row, sha256="0" * 64)])
    with pytest.raises(ValueError, match="files do not match the recorded sha256"):
        evaluate_recorded_checkpoint(home, lake, run_id, 3, "heldout")
    with pytest.raises(LookupError, match="no checkpoint"):
        evaluate_recorded_checkpoint(home, lake, run_id, 99, "heldout")
    with pytest.raises(ValueError, match="unknown benchmark"):
        evaluate_recorded_checkpoint(home, lake, run_id, 1, "mmlu")
