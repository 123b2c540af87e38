"""The arithmetic task: deterministic, disjoint splits, exact verifier that never raises."""

import pytest

from factory.config import TaskSpec
from factory.envs.arithmetic import make_splits, reward
from factory.problem import Problem


def test_splits_are_deterministic_and_disjoint():
    task = TaskSpec(operations=["add", "sub", "mul"], digits=[1, 2], n_train=2000, n_eval=300)
    a, b = make_splits(task, seed=7), make_splits(task, seed=7)
    assert a == b and a.fingerprint() == b.fingerprint()
    assert make_splits(task, seed=8).fingerprint() != a.fingerprint()
    train_ids = {p.id for p in a.train}
    assert len(train_ids) == 2000 and len(a.eval) == 300
    assert not train_ids & {p.id for p in a.eval}
    assert {p.op for p in a.train} == {"add", "sub", "mul"} and {p.digits for p in a.train} == {1, 2}


@pytest.mark.parametrize("op,a,b,reverse,rev_ops,prompt,answer", [
    ("add", 47, 85, True, False, "47+85=", "231"),
    ("add", 47, 85, False, False, "47+85=", "132"),
    ("sub", 12, 47, True, False, "47-12=", "53"),  # operands swapped: results stay non-negative
    ("mul", 12, 34, True, True, "21*43=", "804"),
])
def test_answers_and_formats(op, a, b, reverse, rev_ops, prompt, answer):
    from factory.envs.arithmetic import _problem

    p = _problem(a, op, b, 2, reverse, rev_ops)
    assert (p.prompt, p.answer) == (prompt, answer)


def test_every_generated_answer_is_correct():
    task = TaskSpec(operations=["add", "sub", "mul"], digits=[2], n_train=500, n_eval=50, reverse_answer=False)
    for p in make_splits(task, 0).train:
        assert eval(p.prompt[:-1]) == int(p.answer)  # noqa: S307 - our own generated digits


def test_reward_exact_and_malformed_is_zero():
    p = Problem(id="x", prompt="1+1=", answer="2", op="add", digits=1)
    assert reward("2", p) == 1.0 and reward(" 2 ", p) == 1.0
    assert reward("3", p) == 0.0 and reward("", p) == 0.0 and reward("2+", p) == 0.0
    assert reward(None, p) == 0.0  # type: ignore[arg-type]


def test_too_many_problems_for_the_space_is_a_clear_error():
    with pytest.raises(ValueError, match="n_train \\+ n_eval"):
        make_splits(TaskSpec(digits=[1], n_train=100, n_eval=10), 0)
