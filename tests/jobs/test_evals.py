"""Periodic evals: the new-checkpoint sensor, the catch-up schedule, and the regression check, with real
checkpoints, real evaluations and real Dagster materializations in a temp instance."""

from datetime import UTC, datetime

import pytest
from dagster import MultiPartitionKey, build_schedule_context, build_sensor_context, instance_for_test, materialize

from assets.evals import checkpoint_eval, checkpoints
from factory.checkpoint_eval import checkpoint_key, parse_checkpoint_key
from factory.config import parse_spec
from factory.experiment import build_dataset, load_dataset, run_grpo, train_sft_checkpoint
from factory.lake import Lake
from factory.models.build import build_model
from factory.models.checkpoint import save_checkpoint
from factory.models.tokenizer import build_tokenizer
from factory.tracking import Tracker
from jobs.evals import eval_schedule, new_checkpoint_evals
from resources import FactoryHomeResource, LakeResource

# Two-digit additions written least-significant digit first: a micro model learns some in 600 SFT steps.
SPEC = {"seed": 0, "name": "evals", "model": {"preset": "micro"},
        "task": {"digits": [2], "operations": ["add"], "n_train": 2000, "n_eval": 60, "reverse_answer": True,
                 "reverse_operands": True},
        "sft": {"steps": 600, "stop_at_accuracy": None, "lr": 3e-3},
        "algorithm": {"lr": 1e-7, "group_size": 4},  # RL that barely moves: consecutive checkpoints agree
        "rollout": {"max_new_tokens": 4, "prompts_per_step": 4},
        "schedule": {"steps": 2, "checkpoint_every": 1, "eval_pass_k": 2}}


def resources(home) -> dict:
    h = FactoryHomeResource(root=str(home.root))
    return {"home": h, "lake": LakeResource(home=h)}


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
    run = run_grpo(spec, home, sft.checkpoint.path, splits, lake, Tracker(home), log=lambda _: None)
    tok = build_tokenizer()
    bad = save_checkpoint(build_model("micro", tok, seed=1), tok, home.checkpoints / run.run_id / "step-000003")
    lake.upsert("checkpoints", [dict(run_id=run.run_id, step=3, kind="rl", uri=str(bad.path), bytes=bad.bytes,
                                     sha256=bad.sha256, recorded_at=datetime.now(UTC))])
    return home, run.run_id


def test_checkpoint_keys_round_trip():
    assert parse_checkpoint_key(checkpoint_key("a-b@c-1", 12)) == ("a-b@c-1", 12)
    with pytest.raises(ValueError, match="not a checkpoint key"):
        parse_checkpoint_key("run-without-step")


def test_sensor_schedule_and_regression_check(recorded):
    home, run_id = recorded
    keys = [checkpoint_key(run_id, s) for s in (1, 2, 3)]
    with instance_for_test() as instance:
        # the sensor: every new checkpoint x benchmark, partitions registered, nothing twice
        with build_sensor_context(instance=instance, resources=resources(home)) as ctx:
            res = new_checkpoint_evals(ctx)
        assert res.dynamic_partitions_requests[0].partition_keys == keys
        want = [MultiPartitionKey({"checkpoint": k, "benchmark": b}) for k in keys for b in ("heldout", "carry_chains")]
        assert sorted(str(r.partition_key) for r in res.run_requests) == sorted(map(str, want))
        with build_sensor_context(instance=instance, resources=resources(home), cursor=res.cursor) as ctx:
            assert new_checkpoint_evals(ctx).run_requests == []
        instance.add_dynamic_partitions(checkpoints.name, keys)

        checks = {}
        for k in keys:
            pk = MultiPartitionKey({"checkpoint": k, "benchmark": "heldout"})
            r = materialize([checkpoint_eval], partition_key=pk, instance=instance, resources=resources(home),
                            run_config={"ops": {"checkpoint_eval": {"config": {"regression_tolerance": 0.05}}}})
            assert r.success  # a failed check does not fail the run; it is recorded on the asset
            (ev,) = r.get_asset_check_evaluations()
            checks[parse_checkpoint_key(k)[1]] = ev
        assert checks[1].passed and checks[1].metadata["previous_step"].value == -1  # nothing before it
        assert checks[2].passed and checks[2].metadata["previous_step"].value == 1
        assert not checks[3].passed  # the untrained weights lost what SFT taught
        assert checks[3].metadata["drop"].value > 0.05

        lake = Lake.open(home)
        acc = {r["step"]: r["value"] for r in lake.read("evals").to_pylist()
               if r["run_id"] == run_id and r["benchmark"] == "arithmetic_heldout" and r["metric"] == "accuracy"}
        assert acc[3] < acc[2] - 0.05

        # the schedule: what is recorded but not evaluated yet (the other benchmark), and only that
        with build_schedule_context(instance=instance, resources=resources(home)) as ctx:
            todo = eval_schedule(ctx)
        assert sorted(str(r.partition_key) for r in todo) == sorted(
            str(MultiPartitionKey({"checkpoint": k, "benchmark": "carry_chains"})) for k in keys)
        pk = todo[0].partition_key
        assert materialize([checkpoint_eval], partition_key=pk, instance=instance, resources=resources(home)).success
        assert any(r["benchmark"] == "carry_chains" for r in lake.read("evals").to_pylist())
        with build_schedule_context(instance=instance, resources=resources(home)) as ctx:
            assert len(eval_schedule(ctx)) == 2


def test_a_checkpoint_whose_files_changed_is_not_evaluated(recorded, tmp_path):
    home, run_id = recorded
    from factory.checkpoint_eval import evaluate_recorded_checkpoint

    lake = Lake.open(home)
    (row,) = [r for r in lake.read("checkpoints").to_pylist() if r["run_id"] == run_id and r["step"] == 3]
    lake.upsert("checkpoints", [dict(row, sha256="0" * 64)])
    with pytest.raises(ValueError, match="files do not match the recorded sha256"):
        evaluate_recorded_checkpoint(home, lake, run_id, 3, "heldout")
    with pytest.raises(LookupError, match="no checkpoint"):
        evaluate_recorded_checkpoint(home, lake, run_id, 99, "heldout")
    with pytest.raises(ValueError, match="unknown benchmark"):
        evaluate_recorded_checkpoint(home, lake, run_id, 1, "mmlu")
