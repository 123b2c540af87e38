"""Factory's Dagster instance settings: written fresh, added to an older file without losing what it sets, and
read back by a real DagsterInstance (the eval and summary limits the sensors use come from there)."""

import pytest
import yaml
from dagster import DagsterInstance
from dagster._core.test_utils import environ

from factory.ops.instance import (
    EVAL_QUEUE,
    QUEUE_TAG,
    RECOVERY_SETTINGS,
    SUMMARY_QUEUE,
    ensure_instance_yaml,
    instance_settings,
)
from jobs._queue import eval_limit, summary_limit
from resources.run_launcher import WatchedRunLauncher


def _instance(home):
    with environ({"DAGSTER_HOME": str(home)}):
        return DagsterInstance.get()


@pytest.mark.slow
def test_a_fresh_home_gets_factorys_settings(tmp_path):
    changes = ensure_instance_yaml(tmp_path, max_concurrent_runs=3, max_concurrent_evals=2)
    assert changes == [f"{tmp_path / 'dagster.yaml'}: written with Factory's settings"]
    assert yaml.safe_load((tmp_path / "dagster.yaml").read_text()) == instance_settings(3, 2)
    assert ensure_instance_yaml(tmp_path) == []  # a second call changes nothing
    with _instance(tmp_path) as inst:
        queue = inst.get_concurrency_config().run_queue_config
        assert queue.max_concurrent_runs == 3 and eval_limit(inst) == 2
        assert summary_limit(inst) == 1  # summaries have their own queue: never two at once, whatever evals run
        # a run worker that dies is noticed, its run marked failed and retried (tests/jobs/test_run_worker_kill.py)
        assert isinstance(inst.run_launcher, WatchedRunLauncher)
        assert inst.run_monitoring_enabled and inst.run_monitoring_max_resume_run_attempts == 0
        assert inst.run_retries_enabled and inst.run_retries_max_retries == 0
        assert inst.run_retries_retry_on_asset_or_op_failure is False


@pytest.mark.slow
def test_the_file_an_older_demo_wrote_gains_the_queue_and_keeps_its_settings(tmp_path):
    # What `make demo` used to write: telemetry only, no run queue (issue 9, defect 1).
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: true\n")
    changes = ensure_instance_yaml(tmp_path)
    assert any("eval run(s) at once" in c for c in changes)
    cfg = yaml.safe_load((tmp_path / "dagster.yaml").read_text())
    assert cfg["telemetry"] == {"enabled": True}  # the user's choice is kept
    assert {k: cfg[k] for k in RECOVERY_SETTINGS} == RECOVERY_SETTINGS  # what the demo wrote before issue 24 lacked
    assert "run_retries: enabled true, max_retries 0, retry_on_asset_or_op_failure false" in " ".join(changes)
    assert cfg["concurrency"]["runs"]["tag_concurrency_limits"] == [
        {"key": QUEUE_TAG, "value": EVAL_QUEUE, "limit": 1}, {"key": QUEUE_TAG, "value": SUMMARY_QUEUE, "limit": 1}]
    with _instance(tmp_path) as inst:
        assert eval_limit(inst) == 1 and summary_limit(inst) == 1


@pytest.mark.slow
def test_an_old_style_run_coordinator_gets_the_eval_limit_in_place(tmp_path):
    old = {"run_coordinator": {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator",
                               "config": {"max_concurrent_runs": 5, "tag_concurrency_limits": [
                                   {"key": "factory/queue", "value": "eval", "limit": 3}]}}}
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(old))
    ensure_instance_yaml(tmp_path)
    cfg = yaml.safe_load((tmp_path / "dagster.yaml").read_text())
    assert "concurrency" not in cfg  # Dagster refuses limits in both places
    assert cfg["run_coordinator"]["config"]["tag_concurrency_limits"] == [
        *old["run_coordinator"]["config"]["tag_concurrency_limits"],  # an operator's own eval limit is kept
        {"key": QUEUE_TAG, "value": SUMMARY_QUEUE, "limit": 1}]
    with _instance(tmp_path) as inst:
        assert eval_limit(inst) == 3 and summary_limit(inst) == 1


def test_a_broken_file_is_named_and_left_alone(tmp_path):
    (tmp_path / "dagster.yaml").write_text("telemetry: [\n")
    with pytest.raises(ValueError, match="dagster.yaml: not valid YAML"):
        ensure_instance_yaml(tmp_path)
    assert (tmp_path / "dagster.yaml").read_text() == "telemetry: [\n"


def test_an_instance_without_factorys_queue_still_has_an_eval_limit():
    with DagsterInstance.ephemeral() as inst:
        assert eval_limit(inst) == 1


def test_recovery_settings_a_file_sets_itself_are_kept(tmp_path):
    # An operator who turned run retries off, with a launcher of their own, keeps both; monitoring is added.
    own = {"run_retries": {"enabled": False}, "run_launcher": {"module": "dagster", "class": "DefaultRunLauncher"}}
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(own))
    changes = ensure_instance_yaml(tmp_path)
    cfg = yaml.safe_load((tmp_path / "dagster.yaml").read_text())
    assert cfg["run_retries"] == own["run_retries"] and cfg["run_launcher"] == own["run_launcher"]
    assert cfg["run_monitoring"] == RECOVERY_SETTINGS["run_monitoring"]
    assert not [c for c in changes if "run_retries" in c or "run_launcher" in c]


@pytest.mark.slow
def test_a_file_from_before_summaries_had_their_own_queue_gains_the_summary_limit(tmp_path):
    # What `make demo` wrote while summaries shared the eval limit: the eval limit only (here an operator's 2).
    old = instance_settings(max_concurrent_evals=2)
    old["concurrency"]["runs"]["tag_concurrency_limits"] = [{"key": QUEUE_TAG, "value": EVAL_QUEUE, "limit": 2}]
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(old))
    path = tmp_path / "dagster.yaml"
    assert ensure_instance_yaml(tmp_path) == [
        f"{path}: added run queue: at most 1 summary run(s) at once (factory/queue=summary)"]
    assert yaml.safe_load(path.read_text())["concurrency"]["runs"]["tag_concurrency_limits"] == [
        {"key": QUEUE_TAG, "value": EVAL_QUEUE, "limit": 2}, {"key": QUEUE_TAG, "value": SUMMARY_QUEUE, "limit": 1}]
    assert ensure_instance_yaml(tmp_path) == []
    with _instance(tmp_path) as inst:
        assert eval_limit(inst) == 2 and summary_limit(inst) == 1


def test_an_operators_limit_on_every_queue_is_left_as_it_is(tmp_path):
    # A limit on the tag whatever its value (evals and summaries together) is the operator's choice: kept alone.
    own = {"concurrency": {"runs": {"max_concurrent_runs": 2,
                                    "tag_concurrency_limits": [{"key": QUEUE_TAG, "limit": 1}]}}}
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(own))
    changes = ensure_instance_yaml(tmp_path)
    cfg = yaml.safe_load((tmp_path / "dagster.yaml").read_text())
    assert cfg["concurrency"]["runs"]["tag_concurrency_limits"] == [{"key": QUEUE_TAG, "limit": 1}]
    assert not [c for c in changes if "run queue" in c]


def test_an_instance_without_factorys_queue_still_has_a_summary_limit():
    with DagsterInstance.ephemeral() as inst:
        assert summary_limit(inst) == 1
