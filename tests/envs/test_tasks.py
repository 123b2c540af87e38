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


# ------------------------------------------------------------------ the registries (factory/protocols/task.py)


def test_builtin_families_resolve_by_name_and_keep_their_sizes():
    from factory.envs.tasks import family, longest_prompt_tokens, task_capacity
    from factory.protocols import TASK_FAMILIES, TaskFamily

    assert TASK_FAMILIES.builtin_names() == ("arithmetic", "word_problems", "code")
    for name in TASK_FAMILIES.builtin_names():
        assert isinstance(TASK_FAMILIES.get(name), TaskFamily) and TASK_FAMILIES.get(name).name == name
    # The figures of the if/elif chains these replaced (efceeb9)
    arithmetic, words, code = TaskSpec(), TaskSpec(name="word_problems"), TaskSpec(name="code")
    assert [task_capacity(t) for t in (arithmetic, words, code)] == [(818100, 409050), (400, 400), (24, 24)]
    assert [longest_prompt_tokens(t) for t in (arithmetic, words, code)] == [9, 98, 91]
    assert family(arithmetic).describe(arithmetic) == "task arithmetic with operations ['add'] and digits [2, 3]"


def test_a_problem_is_scored_by_the_verifier_its_op_names():
    from factory.envs.families import arithmetic, code, field, word_problems
    from factory.envs.tasks import is_task_verifier, runs_hack_detectors, verifier_for
    from factory.protocols.task import VERIFIERS, RewardVerifier

    def of(op):
        return verifier_for(Problem(id="x", prompt="p", answer="1", op=op, digits=0))

    assert of("add") is of("mul") is of("arithmetic") is of("no-such-op") is arithmetic.VERIFIER
    assert of("word") is word_problems.VERIFIER and of("code") is code.VERIFIER
    assert of("humaneval") is field.HUMANEVAL and of("reasoning_gym") is field.REASONING_GYM
    assert of("code") is code.FAMILY.verifier
    assert of("word_problems") is arithmetic.VERIFIER  # as before: a built-in family's name is no op of its rows
    codep, wordp = Problem("c", "p", "a", "code", 0), Problem("w", "p", "a", "word", 0)
    assert runs_hack_detectors(codep) and runs_hack_detectors(codep, "code")
    assert not runs_hack_detectors(codep, "my_pkg.env:reward") and not runs_hack_detectors(wordp)
    assert is_task_verifier("humaneval") and not is_task_verifier("add") and not is_task_verifier("word")
    VERIFIERS.register("upper", RewardVerifier(lambda completion, problem: completion.isupper()))
    try:
        assert verify("YES", Problem("u", "p", "", "upper", 0)) == 1.0
        assert verify("no", Problem("u", "p", "", "upper", 0)) == 0.0
    finally:
        VERIFIERS.unregister("upper")


def test_reward_verifier_scores_what_a_reward_function_raises_or_returns_badly_zero():
    from factory.protocols.task import RewardVerifier

    p = Problem("x", "p", "a", "x", 0)
    assert RewardVerifier(lambda c, q: 1 / 0).detail("c", p) == (0.0, frozenset())
    assert RewardVerifier(lambda c, q: float("nan")).detail("c", p) == (0.0, frozenset())
    assert RewardVerifier(lambda c, q: "abc").detail("c", p) == (0.0, frozenset())
    assert RewardVerifier(lambda c, q: True).detail("c", p) == (1.0, frozenset())


def test_task_name_is_checked_against_the_registry():
    from factory.config import SpecError, parse_spec

    with pytest.raises(SpecError) as e:
        parse_spec({"task": {"name": "arithmetc"}})
    assert str(e.value) == ("invalid spec:\n  task.name: unknown task family 'arithmetc'; one of arithmetic, "
                            "word_problems, code, or an import path 'package.module:attr' (or a plugin's entry "
                            "point in group 'factory.task_families')")
    with pytest.raises(SpecError, match=r"task.name: cannot import 'nope' from 'factory.envs.tasks'"):
        parse_spec({"task": {"name": "factory.envs.tasks:nope"}})


def test_the_environment_service_scores_a_registered_family_by_its_name():
    from dataclasses import replace

    from factory.envs.families.word_problems import FAMILY
    from factory.envs.service import score_completions
    from factory.protocols import TASK_FAMILIES
    from factory.protocols.task import RewardVerifier

    TASK_FAMILIES.register("shout", replace(FAMILY, name="shout", verifier=RewardVerifier(
        lambda completion, problem: completion == problem.answer.upper())))
    try:
        problem = {"id": "s", "prompt": "say hi", "answer": "hi", "op": "shout", "digits": 0, "meta": {}}
        assert score_completions("shout", problem, ["HI", "hi"]) == ([1.0, 0.0], [None, None])
    finally:
        TASK_FAMILIES.unregister("shout")
    rewards, reasons = score_completions("whisper", {**problem, "op": "whisper"}, ["hi"])
    assert rewards == [0.0] and "unknown env 'whisper'" in reasons[0]
