"""LineageIOManager on a toy graph: an input is the upstream materialization of the run that produced it; an upstream
outside the run falls back to its latest materialization (its partition's, when partitioned); one never materialized
fails by name. The race it exists for, two quickstarts at once, is tests/jobs/test_quickstart_lineage.py."""

from __future__ import annotations

import pytest
from dagster import (
    AssetIn,
    DagsterInstance,
    MaterializeResult,
    StaticPartitionsDefinition,
    asset,
    materialize,
)

from resources.lineage import LineageIOManager

RESOURCES = {"lineage": LineageIOManager()}
seen: list[dict] = []


@asset(io_manager_key="lineage")
def upstream_file(context) -> MaterializeResult:
    return MaterializeResult(metadata={"path": f"/files/{context.run.run_id}", "sha256": context.run.run_id[:8]})


@asset(ins={"ref": AssetIn("upstream_file")})
def downstream(ref: dict) -> MaterializeResult:
    seen.append(ref)
    return MaterializeResult(metadata={"used": ref["path"]})


@pytest.fixture
def instance():
    seen.clear()
    with DagsterInstance.ephemeral() as inst:
        yield inst


def loaded(instance: DagsterInstance, run_id: str) -> list[dict]:
    return [{k: v.value for k, v in e.dagster_event.event_specific_data.metadata.items()}
            for e in instance.all_logs(run_id)
            if e.dagster_event and e.dagster_event.event_type_value == "LOADED_INPUT"]


def test_an_input_is_the_materialization_of_its_own_run(instance):
    first = materialize([upstream_file, downstream], instance=instance, resources=RESOURCES)
    second = materialize([upstream_file, downstream], instance=instance, resources=RESOURCES)
    assert [r["path"] for r in seen] == [f"/files/{first.run_id}", f"/files/{second.run_id}"]
    # the run's log names the materialization each step read
    assert loaded(instance, second.run_id) == [{"upstream_dagster_run": second.run_id,
                                                "path": f"/files/{second.run_id}", "sha256": second.run_id[:8]}]


def test_an_upstream_outside_the_run_is_its_latest_materialization(instance):
    materialize([upstream_file], instance=instance, resources=RESOURCES)
    latest = materialize([upstream_file], instance=instance, resources=RESOURCES)
    alone = materialize([downstream, upstream_file], selection=[downstream], instance=instance, resources=RESOURCES)
    assert seen == [{"path": f"/files/{latest.run_id}", "sha256": latest.run_id[:8]}]
    logs = [e.user_message for e in instance.all_logs(alone.run_id)]
    assert any(f"upstream_file was not materialized in this run: using its latest materialization (run "
               f"{latest.run_id})" in m for m in logs)


def test_an_upstream_never_materialized_fails_by_name(instance):
    result = materialize([downstream, upstream_file], selection=[downstream], instance=instance, resources=RESOURCES,
                         raise_on_error=False)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "upstream asset 'upstream_file' has no materialization yet" in str(failure.event_specific_data.error)


parts = StaticPartitionsDefinition(["a", "b"])


@asset(io_manager_key="lineage", partitions_def=parts)
def part_file(context) -> MaterializeResult:
    return MaterializeResult(metadata={"path": f"/files/{context.partition_key}"})


@asset(ins={"ref": AssetIn("part_file")}, partitions_def=parts)
def part_user(ref: dict) -> MaterializeResult:
    seen.append(ref)
    return MaterializeResult()


def test_a_partitioned_upstream_outside_the_run_is_its_partitions_latest(instance):
    for key in ("a", "b"):
        materialize([part_file], partition_key=key, instance=instance, resources=RESOURCES)
    materialize([part_user, part_file], selection=[part_user], partition_key="a", instance=instance,
                resources=RESOURCES)
    assert seen == [{"path": "/files/a"}]


def test_a_value_returned_to_it_is_refused(instance):
    @asset(io_manager_key="lineage")
    def returns_a_value() -> int:
        return 1

    result = materialize([returns_a_value], instance=instance, resources=RESOURCES, raise_on_error=False)
    assert not result.success
