"""Interruption records across several attempts (`runs/recovery.py`): every row is filled in once a later attempt
starts training, including the row of an attempt whose successor died before its first step, and each row's costs
are that attempt's own (redo_s never carries the time of earlier attempts), so goodput stays right."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from factory.runs import recovery

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "r-costs"


def _cut(attempt: int, failed_s: float, detect_s: float, last_step: int) -> dict:
    return dict(run_id=RUN, attempt=attempt, cause="killed", detail="test", last_step=last_step,
                failed_at=T0 + timedelta(seconds=failed_s), detect_s=detect_s,
                recorded_at=T0 + timedelta(seconds=failed_s + detect_s))


def _rows(lake) -> dict[int, dict]:
    return {r["attempt"]: r for r in lake.read("interruptions").to_pylist()}


def test_every_open_interruption_is_closed_with_its_own_costs(lake):
    # Attempt 1 trained from t=10, wrote a resume point of step 4 at t=90, died at t=100 after step 6 (noticed
    # 2 s later). Attempt 2 died at t=130 before its first step (during its start). Attempt 3 starts training
    # from step 4 at t=150.
    lake.upsert("interruptions", [_cut(1, 100, 2, 6), _cut(2, 130, 1, 6)])
    recovery.close_open_interruptions(lake, RUN, attempt=3, resumed_from=4, saved_at=T0.timestamp() + 90,
                                      started_at=T0.timestamp() + 150, work=(1, T0.timestamp() + 10))
    rows = _rows(lake)
    one, two = rows[1], rows[2]
    assert (one["resumed_from_step"], one["steps_lost"]) == (4, 2)
    assert one["redo_s"] == 10.0  # t=90 -> t=100: attempt 1's work after the resume point
    assert one["recover_s"] == 28.0  # noticed at 102; its recovery (attempt 2) ran until attempt 2 died at 130
    assert (two["resumed_from_step"], two["steps_lost"], two["redo_s"]) == (4, 2, 0.0)  # it trained nothing
    assert two["recover_s"] == 19.0  # noticed at 131 -> attempt 3's first step at 150
    assert recovery.lost_seconds(lake, RUN) == 10 + 2 + 28 + 0 + 1 + 19


def test_redo_does_not_accumulate_over_attempts_that_resume_from_the_same_point(lake):
    # The resume point of step 4 was saved at t=90 by attempt 1 (died at 100). Attempt 2 resumed from it, started
    # training at t=120 and died at t=160 after 2 steps, before its next resume point: its redo is 40 s (its own
    # work), not 70 s (which would count attempt 1's redo, detection and recovery again).
    lake.upsert("interruptions", [_cut(1, 100, 2, 6)])
    recovery.close_open_interruptions(lake, RUN, attempt=2, resumed_from=4, saved_at=T0.timestamp() + 90,
                                      started_at=T0.timestamp() + 120, work=(1, T0.timestamp() + 10))
    lake.upsert("interruptions", [_cut(2, 160, 1, 6)])
    recovery.close_open_interruptions(lake, RUN, attempt=3, resumed_from=4, saved_at=T0.timestamp() + 90,
                                      started_at=T0.timestamp() + 170, work=(2, T0.timestamp() + 120))
    rows = _rows(lake)
    assert rows[1]["redo_s"] == 10.0 and rows[1]["recover_s"] == 18.0  # closed once, by attempt 2: not reopened
    assert rows[2]["redo_s"] == 40.0 and rows[2]["recover_s"] == 9.0
    lost = recovery.lost_seconds(lake, RUN)
    assert lost == (10 + 2 + 18) + (40 + 1 + 9)
    assert 0 < recovery.goodput(200.0, lost) < 1


def test_without_a_record_of_when_work_started_redo_runs_from_the_resume_point(lake):
    # A run dir from another host or an older release has no work record: the cost runs from the resume point.
    lake.upsert("interruptions", [_cut(1, 100, 0, 6)])
    recovery.close_open_interruptions(lake, RUN, attempt=2, resumed_from=4, saved_at=T0.timestamp() + 90,
                                      started_at=T0.timestamp() + 110, work=None)
    assert _rows(lake)[1]["redo_s"] == 10.0
