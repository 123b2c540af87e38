"""What a resumed run's Dagster page says about its interruptions (assets/_interruptions.py): from the lake's real
`interruptions` rows (recorded and closed as a run's attempts do), a sentence with the cause, the step reached and the
step resumed from, and, in a real materialization, a warning in the run's log and an AssetObservation of the asset."""


import logging

from dagster import (
    AssetExecutionContext,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    MaterializeResult,
    asset,
    materialize,
)

from assets._interruptions import describe, interruptions, report_interruptions, tell_the_failed_run
from factory.runs import recovery


def _crashed_at_17_resumed_from_10(lake) -> None:
    """Attempt 1 of run r1 crashes after step 17; attempt 2 starts training from the resume point of step 10."""
    recovery.record_interruption(lake, "r1", 1, "crash", "InjectedFault: fault injected at publish", last_step=17)
    failed = recovery.stamp(interruptions(lake, "r1")[0]["failed_at"])
    # resume point saved 30 s before the crash, attempt 1 trained from 60 s before it, attempt 2 trains 12 s after it
    recovery.close_open_interruptions(lake, "r1", 2, resumed_from=10, saved_at=failed - 30, started_at=failed + 12,
                                      work=(1, failed - 60))


def test_an_interruption_is_told_with_its_cause_steps_and_cost(lake):
    _crashed_at_17_resumed_from_10(lake)
    (row,) = interruptions(lake, "r1")
    assert describe(row) == ("attempt 1 crashed at step 17; resumed from step 10 "
                             "(7 steps trained again, 42 s lost)")


def test_one_not_resumed_yet_and_a_cause_without_words_are_told_too():
    row = {"attempt": 3, "cause": "meteor", "last_step": None, "resumed_from_step": None}
    assert describe(row) == "attempt 3 meteor; not resumed yet"
    lost = {"attempt": 1, "cause": "supervisor_lost", "last_step": 5, "resumed_from_step": 5, "steps_lost": 0}
    assert describe(lost) == ("attempt 1 stopped at step 5 (its supervisor died: the Dagster run worker or "
                              "`factory run`); resumed from step 5 (0 steps trained again)")


def test_a_materialization_logs_and_observes_each_interruption(lake):
    _crashed_at_17_resumed_from_10(lake)

    @asset
    def trained(context: AssetExecutionContext) -> MaterializeResult:
        assert report_interruptions(context, lake, "r1") == 1
        assert report_interruptions(context, lake, "never-interrupted") == 0
        return MaterializeResult()

    with DagsterInstance.ephemeral() as instance:
        result = materialize([trained], instance=instance)
        logs = instance.all_logs(result.run_id)
    (obs,) = [e.asset_observation for e in logs
              if e.dagster_event and e.dagster_event.event_type == DagsterEventType.ASSET_OBSERVATION]
    assert obs.asset_key.path == ["trained"]
    md = {k: v.value for k, v in obs.metadata.items()}
    assert {k: md[k] for k in ("run_id", "cause", "attempt", "stopped_at_step", "resumed_from_step", "steps_lost",
                               "lost_s")} == {"run_id": "r1", "cause": "crash", "attempt": 1, "stopped_at_step": 17,
                                              "resumed_from_step": 10, "steps_lost": 7, "lost_s": 42.0}
    assert md["interrupted"].startswith("attempt 1 crashed at step 17") and "fault injected" in md["detail"]
    warnings = [e.user_message for e in logs if e.level == logging.WARNING]
    assert any("run r1: attempt 1 crashed at step 17; resumed from step 10" in w for w in warnings)


def test_a_run_whose_worker_was_killed_gets_factorys_account_beside_dagsters_oom_guess(lake):
    """Issue 24: a killed run worker's run showed only Dagster's "out of memory" hint. The code server's own event
    (the real `get_run_crash_explanation` text for a SIGKILL) stays; the retry that resumed the factory run adds
    Factory's account to the failed run, once."""
    from dagster._core.test_utils import create_run_for_test
    from dagster._utils import get_run_crash_explanation

    recovery.record_interruption(lake, "r1", 1, "supervisor_lost", "the run worker (pid 7) is gone", last_step=4)
    failed = recovery.stamp(interruptions(lake, "r1")[0]["failed_at"])
    recovery.close_open_interruptions(lake, "r1", 2, resumed_from=4, saved_at=failed, started_at=failed + 20,
                                      work=(1, failed - 60))
    (row,) = interruptions(lake, "r1")
    with DagsterInstance.ephemeral() as instance:
        parent = create_run_for_test(instance, job_name="quickstart", status=DagsterRunStatus.FAILURE)
        instance.report_engine_event(get_run_crash_explanation(f"Run execution process for {parent.run_id}", -9),
                                     parent)
        retry = create_run_for_test(instance, job_name="quickstart", parent_run_id=parent.run_id,
                                    root_run_id=parent.run_id)
        assert tell_the_failed_run(instance, retry, "r1", row)
        assert not tell_the_failed_run(instance, retry, "r1", row)  # once per failed run
        done = create_run_for_test(instance, job_name="quickstart", status=DagsterRunStatus.SUCCESS)
        assert not tell_the_failed_run(instance, create_run_for_test(
            instance, job_name="quickstart", parent_run_id=done.run_id, root_run_id=done.run_id), "r1", row)
        events = [e.dagster_event for e in instance.all_logs(parent.run_id, of_type=DagsterEventType.ENGINE_EVENT)]
    dagsters, factorys = events
    assert "running out of memory" in dagsters.message  # Dagster's guess for any SIGKILL, left as it is
    assert factorys.message == (
        f"Factory: run r1: attempt 1 stopped at step 4 (its supervisor died: the Dagster run worker or `factory run`);"
        f" resumed from step 4 (0 steps trained again, 20 s lost), by Dagster run {retry.run_id}. Dagster's "
        "out-of-memory hint above is the one it gives every run worker killed by SIGKILL: the run worker died; what "
        "the training run did is this.")
    md = {k: v.value for k, v in factorys.engine_event_data.metadata.items()}
    assert (md["cause"], md["stopped_at_step"], md["resumed_from_step"], md["retry_run_id"]) == (
        "supervisor_lost", 4, 4, retry.run_id)
