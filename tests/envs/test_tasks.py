"""Task families: shipped word and code problems, answer extraction, verifiers."""

import pytest

from factory.config import TaskSpec
from factory.envs.tasks import extract_answer, make_task_splits, verify, word_problem_reward
from factory.problem import Problem


@pytest.mark.parametrize("text,want", [
    ("The answer is \\boxed{42}.", "42"), ("first 3, then \\boxed{7} and \\boxed{9}", "9"),
    ("so 12 + 30 = 42", "42"), ("-5 degrees", "-5"), ("no digits here", None), ("2.5 kg", "2.5"),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_word_problem_verifier():
    p = Problem(id="w", prompt="q", answer="42", op="word", digits=0)
    assert word_problem_reward("It is \\boxed{42}", p) == 1.0
    assert word_problem_reward("42.0", p) == 1.0 and word_problem_reward("41", p) == 0.0
    assert word_problem_reward("", p) == 0.0 and verify("\\boxed{x}", p) == 0.0


@pytest.mark.parametrize("name,size", [("word_problems", 400), ("code", 24)])
def test_shipped_sets_split_disjoint_and_reproducibly(name, size):
    task = TaskSpec(name=name, n_train=size - 8, n_eval=8)
    a, b = make_task_splits(task, 0), make_task_splits(task, 0)
    assert [p.id for p in a.train] == [p.id for p in b.train]
    assert not {p.id for p in a.train} & {p.id for p in a.eval}
    assert len(a.train) + len(a.eval) == size
    assert [p.id for p in make_task_splits(task, 1).eval] != [p.id for p in a.eval]
    with pytest.raises(ValueError, match=f"the {name} set has {size} problems"):
        make_task_splits(TaskSpec(name=name, n_train=size, n_eval=8), 0)


def test_word_problem_answers_are_right():
    for p in make_task_splits(TaskSpec(name="word_problems", n_train=392, n_eval=8), 0).train:
        nums = [int(x) for x in extract_answer_all(p.prompt)]
        kind = p.meta["kind"]
        want = {"add": lambda n: n[0] + n[1], "sub": lambda n: n[0] - n[1], "mul": lambda n: n[0] * n[1],
                "div": lambda n: n[0] // n[1], "two_step": lambda n: n[0] + n[1] - n[2]}[kind](nums)
        assert p.answer == str(want), p


def extract_answer_all(text):
    import re

    return re.findall(r"\d+", text)
