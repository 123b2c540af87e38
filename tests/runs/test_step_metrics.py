"""StepMetrics against a real SQLite MLflow store: a step's points are logged once a resume point covers them, so
attempts that die past their resume point (killed, or killed while that point was being written) leave one point
per step in the raw metric history after the run resumes. (The end-to-end case, a real killed `factory run` and
`factory resume`, is in tests/runs/test_rl_run.py.)"""

from __future__ import annotations

import pytest

from factory.cockpit.tracking import Tracker
from factory.home import factory_home
from factory.runs.step_metrics import StepMetrics, source_metrics


@pytest.fixture(scope="module")
def tracker(tmp_path_factory) -> Tracker:
    return Tracker(factory_home(tmp_path_factory.mktemp("step-metrics-home")))


def _raw_steps(tracker: Tracker, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in tracker.client.get_metric_history(run_id, key))


def _train(m: StepMetrics, steps: range, save_every: int, saved: list[int]) -> None:
    """What the run does per step: add the step's metrics, then flush before each resume point is taken."""
    for s in steps:
        m.add(s, {"reward_mean": s / 10, "loss": 1.0 / s})
        if s % save_every == 0:
            m.flush()
            saved.append(s)


def test_an_attempt_killed_past_its_resume_point_leaves_one_point_per_step(tracker):
    run_id = tracker.start_run("step-metrics", "killed")
    first, saved = StepMetrics(tracker, run_id), []
    _train(first, range(1, 6), save_every=2, saved=saved)  # dies after step 5: its resume point is step 4
    assert first.pending() == [5] and _raw_steps(tracker, run_id, "batch/reward_mean") == [1, 2, 3, 4]
    second = StepMetrics(tracker, run_id, resumed_from=saved[-1])
    _train(second, range(5, 9), save_every=2, saved=saved)
    assert _raw_steps(tracker, run_id, "batch/reward_mean") == _raw_steps(tracker, run_id, "batch/loss") == [
        *range(1, 9)]


def test_a_kill_during_a_resume_write_does_not_log_the_redone_steps_twice(tracker):
    run_id = tracker.start_run("step-metrics", "torn")
    first, saved = StepMetrics(tracker, run_id), []
    _train(first, range(1, 7), save_every=2, saved=saved)  # step 6's point was flushed, then its write torn
    assert _raw_steps(tracker, run_id, "batch/reward_mean") == list(range(1, 7))
    second = StepMetrics(tracker, run_id, resumed_from=4)  # the newest complete point
    _train(second, range(5, 9), save_every=2, saved=saved)
    assert second.logged == 2  # 7 and 8; 5 and 6 were already there
    assert _raw_steps(tracker, run_id, "batch/reward_mean") == _raw_steps(tracker, run_id, "batch/loss") == [
        *range(1, 9)]


def test_metrics_of_one_step_added_twice_are_one_batch_and_drop_forgets(tracker):
    run_id = tracker.start_run("step-metrics", "merge")
    m = StepMetrics(tracker, run_id)
    m.add(2, {"reward_mean": 0.5})
    m.add(2, {"eval/accuracy": 0.25})  # the step's periodic eval
    m.add(3, {"reward_mean": 0.7})
    assert m.drop() == [2, 3] and m.flush() == 0
    m.add(2, {"reward_mean": 0.5})
    m.add(2, {"eval/accuracy": 0.25})
    assert m.flush() == 1
    assert tracker.metric_history(run_id, "eval/accuracy") == [(2, 0.25)]
    assert _raw_steps(tracker, run_id, "batch/reward_mean") == [2]


def _sections(keys: list[str]) -> list[str]:
    """MLflow 3.17 UI's chart sections of a run, in the order drawn (mlflow/server/js, extractChartSectionName and
    the section sort): a key's section is its name up to the last '/'; named sections sorted, then the unprefixed
    ones ("Model metrics"), then `system/` ("System metrics")."""
    names = {k.rpartition("/")[0] or "Model metrics" for k in keys}
    names = {"System metrics" if n == "system" else n for n in names}
    return sorted(n for n in names if n not in ("Model metrics", "System metrics")) + [
        n for n in ("Model metrics", "System metrics") if n in names]


def test_reward_and_loss_are_the_first_charts_a_runs_mlflow_page_draws(tracker):
    """The run page drew `data` (counters at 0 in most runs) first and the unprefixed loss and reward last."""
    from dataclasses import MISSING, fields

    from factory.core.loop import StepRecord  # heavy: torch

    run_id = tracker.start_run("step-metrics", "sections")
    required = [f.name for f in fields(StepRecord) if f.default is MISSING and f.default_factory is MISSING]
    record = StepRecord(**dict.fromkeys(required, 0.5), hacks_any=0.0, env_errors=0.0)
    m = StepMetrics(tracker, run_id)
    # what Run.step adds: the record's scalars, the feed's and curriculum's counters, a periodic eval
    m.add(1, {**{k: v for k, v in record.to_dict().items() if k != "step"}, "data/skipped": 0.0, "data/forced": 0.0,
              "curriculum/level": 1.0, "eval/accuracy": 0.25})
    m.flush()
    keys = sorted(tracker.get_run(run_id).data.metrics)
    first = _sections(keys)[0]
    assert first == "batch", _sections(keys)
    assert {"batch/reward_mean", "batch/loss", "batch/accuracy"} <= {k for k in keys if k.startswith("batch/")}
    assert {"data/skipped", "grad_norm", "eval/accuracy"} <= set(keys)  # the others keep their names


def test_the_gap_reaches_mlflow_with_each_sources_and_nothing_where_it_was_not_measured(tracker):
    """What Run.step logs of a record (its scalars, the feed's counters, `source_metrics` of its sources): the gap's
    figures as they were measured, per source under `source/<name>/`; a step without a measured gap has no point
    there (not a 0), so the curve has a hole instead of a false flat line."""
    from tests.gap_records import GAP, gap_record  # heavy: torch

    run_id = tracker.start_run("step-metrics", "gap")
    m = StepMetrics(tracker, run_id)
    for r in (gap_record(1), gap_record(2, measured=False), gap_record(3)):
        m.add(r.step, {**{k: v for k, v in r.to_dict().items() if k != "step"}, **r.data,
                       **source_metrics(r.sources)})
    m.flush()

    def points(key: str) -> dict[int, float]:
        return {p.step: p.value for p in tracker.client.get_metric_history(run_id, key)}

    assert points("gap_kl") == {1: GAP[0][1], 3: GAP[2][1]}
    assert points("gap_abs_mean") == {1: GAP[0][0], 3: GAP[2][0]}
    assert points("correction_masked_tokens") == {1: 0.0, 3: 0.10} and points("recompute_s") == {1: 0.25, 3: 0.75}
    assert points("source/arith/gap_kl") == {1: GAP[0][1] / 2, 3: GAP[2][1] / 2}
    assert points("source/chain/gap_abs_mean") == {1: GAP[0][0] * 2, 3: GAP[2][0] * 2}
    assert sorted(points("batch/loss")) == [1, 2, 3]  # step 2 was logged, without its gap
