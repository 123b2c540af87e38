"""The preflight in Dagster: `node_health` materialized for real (each check an asset check, the table in its
metadata, rows in the lake), the schedule that skips while runs are going, and the training assets refusing a node
whose latest preflight failed."""

import os
import time
import uuid
from pathlib import Path

import pytest
from dagster import (
    DagsterInstance,
    DagsterRunStatus,
    RunRequest,
    SkipReason,
    build_schedule_context,
    instance_for_test,
    materialize,
)
from dagster._core.test_utils import create_run_for_test

from assets.datasets import task_dataset
from assets.preflight import node_health
from assets.training import grpo_run, sft_checkpoint
from factory.lake import Lake
from factory.ops.preflight import run_preflight, select_probes
from jobs import defs, make_resources
from jobs.preflight import PREFLIGHT_CRON, preflight_job, preflight_schedule
from resources import FactoryHomeResource, LakeResource

SPEC = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")


@pytest.fixture
def node(monkeypatch) -> str:
    name = f"dagster-node-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FACTORY_NODE", name)
    return name


@pytest.mark.slow
def test_node_health_materializes_with_an_asset_check_per_check(factory_home, node):
    home = FactoryHomeResource(root=str(factory_home.root))
    with DagsterInstance.ephemeral() as instance:
        result = materialize([node_health], instance=instance,
                             resources={"home": home, "lake": LakeResource(home=home)})
        assert result.success
    quick = [c for p in select_probes("quick") for c in p.checks]
    evals = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert sorted(evals) == sorted(quick)  # deep-only checks (allreduce, rollout_server) are not evaluated
    assert all(e.passed for e in evals.values()), {k: e.metadata["message"].value for k, e in evals.items()
                                                   if not e.passed}
    assert evals["matmul"].metadata["unit"].value == "GFLOP/s" and evals["matmul"].metadata["threshold"].value > 0
    md = result.asset_materializations_for_node("node_health")[0].metadata
    assert md["passed"].value is True and md["failed"].value == "none" and md["node"].value == node
    table = md["checks"].value
    assert [r.data["check"] for r in table.records] == quick and {r.data["status"] for r in table.records} == {"ok"}
    rows = Lake.open(factory_home).read("node_health", f"node == '{node}'").to_pylist()
    assert sorted(r["check"] for r in rows) == sorted(quick)
    assert {r["preflight_id"] for r in rows} == {md["preflight_id"].value}


def test_the_job_and_schedule_are_defined():
    assert defs.resolve_job_def("preflight") is not None
    assert defs.resolve_schedule_def("preflight_schedule").cron_schedule == PREFLIGHT_CRON == os.environ.get(
        "FACTORY_PREFLIGHT_CRON", "0 * * * *")


@pytest.mark.slow
def test_schedule_skips_while_runs_are_going_or_preflight_is_off(monkeypatch):
    monkeypatch.setenv("FACTORY_PREFLIGHT", "gate")
    with instance_for_test() as instance:
        with build_schedule_context(instance=instance) as ctx:
            assert isinstance(preflight_schedule(ctx), RunRequest)
        create_run_for_test(instance, job_name=preflight_job.name, status=DagsterRunStatus.STARTED)
        with build_schedule_context(instance=instance) as ctx:
            assert isinstance(preflight_schedule(ctx), RunRequest)  # a preflight run going is not other work
        busy = create_run_for_test(instance, job_name="quickstart", status=DagsterRunStatus.STARTED)
        with build_schedule_context(instance=instance) as ctx:
            skip = preflight_schedule(ctx)
        assert isinstance(skip, SkipReason) and f"quickstart {busy.run_id[:8]}" in skip.skip_message
        monkeypatch.setenv("FACTORY_PREFLIGHT", "off")
        instance.report_run_canceled(busy)
        with build_schedule_context(instance=instance) as ctx:
            assert preflight_schedule(ctx).skip_message == "FACTORY_PREFLIGHT=off"


@pytest.fixture
def sandbox_check_failed(factory_home, monkeypatch, tmp_path) -> None:
    """A real fault: no bwrap on PATH, so the sandbox check fails and is recorded for this node."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    with monkeypatch.context() as m:
        m.setenv("PATH", str(empty))
        assert not run_preflight(factory_home, only=["sandbox"]).passed


def test_grpo_run_refuses_a_node_that_failed_its_preflight(factory_home, node, monkeypatch, sandbox_check_failed):
    monkeypatch.setenv("FACTORY_PREFLIGHT", "gate")
    with DagsterInstance.ephemeral() as instance:
        # its upstreams never materialized: the gate still names the node first
        result = materialize([task_dataset, sft_checkpoint, grpo_run], selection=[grpo_run], instance=instance,
                             resources=make_resources(SPEC, [], str(factory_home.root)), raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    err = failure.step_failure_data.user_failure_data
    assert f"node {node} failed preflight check(s) sandbox; training refused" in err.description
    assert "bubblewrap not found" in err.description and err.metadata["failed_checks"].value == "sandbox"


@pytest.mark.slow
def test_sweep_member_refuses_a_node_that_failed_its_preflight(factory_home, node, monkeypatch,
                                                              sandbox_check_failed):
    from dagster._daemon.types import DaemonHeartbeat

    with DagsterInstance.ephemeral() as instance:
        instance.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "SENSOR", None, []))  # a daemon would launch it
        cfg = {"name": "gated", "base_spec": SPEC, "overrides": ["model.preset=micro"], "axes": {"seed": [0]}}
        assert defs.resolve_job_def("sweep").execute_in_process(
            run_config={"ops": {"plan_and_queue_sweep": {"config": cfg}}}, instance=instance).success
        (member,) = instance.get_dynamic_partitions("sweep_members")
        monkeypatch.setenv("FACTORY_PREFLIGHT", "gate")
        result = defs.resolve_job_def("sweep_member_job").execute_in_process(
            instance=instance, partition_key=member, raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    err = failure.step_failure_data.user_failure_data.description
    assert "failed preflight check(s) sandbox; training refused" in err
    # It never started: its sweeps row says refused, and why (a retry after the node is fixed runs it).
    (row,) = Lake.open(factory_home).read("sweeps").to_pylist()
    assert row["status"] == "refused" and row["member"] == member
    assert "failed preflight check(s) sandbox; training refused" in row["reason"]
