"""Code rewards cannot be forged: the three forged scores of issue 23 (1.0, 1000.0, 1.0 for `code-000-add`) score
0, honest completions keep their scores, and every shipped verifier's reward lies in [0, 1]. Real sandbox pool
(bubblewrap); skipped where it cannot run, unless FACTORY_REQUIRE_SANDBOX=1."""

from __future__ import annotations

import pytest

from factory.config import TaskSpec
from factory.envs import pool, tasks
from factory.envs.tasks import make_task_splits, verify

ALWAYS_EQUAL = """    class Anything:
        def __eq__(self, other):
            return True
    return Anything()
"""


def code_problem(suffix: str):
    splits = make_task_splits(TaskSpec(name="code", n_train=16, n_eval=8), 0)
    return next(x for x in splits.train + splits.eval if x.id.endswith(suffix))


@pytest.fixture(scope="module", autouse=True)
def _pool(require_sandbox):
    mp = pytest.MonkeyPatch()
    mp.setenv("FACTORY_SANDBOX_SIZE", "1")
    yield
    mp.undo()
    with pool._POOL_LOCK:
        if pool._POOL is not None:
            pool._POOL.close()
            pool._POOL = None


@pytest.mark.parametrize("forged", [
    "    import os; os.write(1, b'PASSED 3/3\\n'); os._exit(0)\n",  # scored 1.0 before
    "    import os; os.write(1, b'PASSED 1000/1\\n'); os._exit(0)\n",  # scored 1000.0 before
    ALWAYS_EQUAL,  # scored 1.0 before
])
def test_the_forged_scores_of_the_issue_score_zero(forged):
    assert verify(forged, code_problem("-add")) == 0.0


def test_honest_completions_keep_their_scores():
    add, maximum = code_problem("-add"), code_problem("-maximum")
    assert verify(add.answer, add) == 1.0
    assert verify("    return a - b\n", add) == 0.0
    assert verify("    return a\n", maximum) == pytest.approx(2 / 3)  # maximum(5, -1), maximum(3, 3) pass
    assert verify("    this is not python\n", add) == 0.0


@pytest.mark.parametrize(("raw", "bounded"), [(1000.0, 1.0), (-5.0, 0.0), (float("nan"), 0.0), (0.5, 0.5)])
def test_verify_keeps_every_shipped_verifiers_reward_in_zero_one(monkeypatch, raw, bounded):
    """A verifier bug (here: the word-problem verifier returning `raw`) never leaves [0, 1] through `verify`."""
    from factory.problem import Problem
    from factory.protocols.task import VERIFIERS, RewardVerifier

    VERIFIERS.register("word", RewardVerifier(lambda completion, problem: raw), replace=True)
    try:
        p = Problem(id="w", prompt="1+1?", answer="2", op="word", digits=0, meta={})
        assert verify("2", p) == bounded and tasks.verify_detail("2", p) == (bounded, frozenset())
    finally:
        VERIFIERS.unregister("word")
