"""Shipped eval suites: the carry_chains suite has what it claims, is formatted exactly as the task
formats problems, and shares no problem with the quickstart's splits."""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from factory.config import TaskSpec, load_spec
from factory.envs.arithmetic import _problem, make_splits, reward
from factory.envs.eval_suites import BENCHMARKS, benchmark_problems, load_suite, suite_names

ROOT = Path(__file__).resolve().parents[2]
BOTH = TaskSpec(operations=["add", "sub"], digits=[3], n_train=100, n_eval=20)


def _digits(n: int) -> list[int]:
    return [n % 10, n // 10 % 10, n // 100]


def _records() -> list[dict]:
    text = (resources.files("factory.envs") / "suites" / "carry_chains.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def quickstart():
    spec = load_spec(ROOT / "examples" / "quickstart.yaml")
    return spec.task, make_splits(spec.task, 0)


def test_carry_chains_is_shipped_with_its_counts():
    assert "carry_chains" in suite_names()
    records = _records()
    assert len(records) == 200 and len({r["id"] for r in records}) == 200
    assert Counter(r["kind"] for r in records) == {
        "generate": 60, "propagate": 60, "ripple": 60, "borrow": 10, "borrow_zero": 10}
    assert len(load_suite("carry_chains", BOTH)) == 200
    assert len(load_suite("carry_chains", TaskSpec(operations=["add"]))) == 180


def test_every_problem_is_the_slice_it_claims():
    for r in _records():
        a, b = r["a"], r["b"]
        assert 100 <= a <= 999 and 100 <= b <= 999 and r["digits"] == 3, r
        da, db = _digits(a), _digits(b)
        sums = [x + y for x, y in zip(da, db, strict=True)]
        if r["op"] == "add":
            # Every column carries out: the units generate, the others generate (>= 10) or pass the
            # incoming carry on (== 9); so the sum has 4 digits.
            assert sums[0] >= 10 and all(s >= 9 for s in sums[1:]) and a + b >= 1000, r
            kind = {0: "generate", 1: "propagate", 2: "ripple"}[sum(s == 9 for s in sums[1:])]
            assert r["kind"] == kind, r
        else:
            assert r["op"] == "sub" and a > b, r
            assert da[0] < db[0] and da[1] <= db[1], r  # borrows out of the units and the tens
            assert r["kind"] == ("borrow_zero" if da[1] == 0 else "borrow"), r


@pytest.mark.parametrize("reverse_answer", [True, False])
@pytest.mark.parametrize("reverse_operands", [True, False])
def test_answers_and_formatting_follow_the_task(reverse_answer, reverse_operands):
    task = BOTH.model_copy(update={"reverse_answer": reverse_answer, "reverse_operands": reverse_operands})
    problems = load_suite("carry_chains", task)
    for r, p in zip(_records(), problems, strict=True):
        value = r["a"] + r["b"] if r["op"] == "add" else r["a"] - r["b"]
        answer = str(value)[::-1] if reverse_answer else str(value)
        sa, sb = (str(r["a"])[::-1], str(r["b"])[::-1]) if reverse_operands else (str(r["a"]), str(r["b"]))
        assert p.prompt == f"{sa}{'+' if r['op'] == 'add' else '-'}{sb}=" and p.answer == answer
        assert (p.id, p.op, p.digits) == (r["id"], r["op"], 3)
        assert p == _problem(r["a"], r["op"], r["b"], 3, reverse_answer, reverse_operands)
        assert reward(answer, p) == 1.0


def test_benchmark_names(quickstart):
    task, splits = quickstart
    assert set(BENCHMARKS) == {"heldout", "carry_chains", "humaneval"}
    assert benchmark_problems("heldout", task, splits) == splits.eval
    assert [p.op for p in benchmark_problems("carry_chains", task, splits)] == ["add"] * 180
    with pytest.raises(ValueError, match="known: heldout, carry_chains, humaneval"):
        benchmark_problems("gsm8k", task, splits)
    with pytest.raises(ValueError, match="shipped: carry_chains"):
        load_suite("nope", task)
    with pytest.raises(ValueError, match=r"no problems for operations \['mul'\]"):
        load_suite("carry_chains", TaskSpec(operations=["mul"]))


def test_no_overlap_with_the_quickstart_splits(quickstart):
    task, splits = quickstart
    suite = {p.id for p in load_suite("carry_chains", task)}
    train_overlap = suite & {p.id for p in splits.train}
    eval_overlap = suite & {p.id for p in splits.eval}
    print(f"carry_chains vs seed-0 quickstart: {len(train_overlap)} in train, {len(eval_overlap)} in eval "
          f"of {len(suite)}")
    assert not train_overlap and not eval_overlap


def test_problems_a_run_trained_on_are_dropped(quickstart):
    task, _ = quickstart
    # Another seed's train split (20k of 810k problems) shares a few problems with the suite by
    # chance; benchmark_problems leaves exactly those out.
    splits = make_splits(task, 1)
    train = {p.id for p in splits.train}
    suite = load_suite("carry_chains", task)
    kept = benchmark_problems("carry_chains", task, splits)
    dropped = {p.id for p in suite} - {p.id for p in kept}
    print(f"carry_chains vs seed-1 quickstart train: {len(dropped)} dropped of {len(suite)}")
    assert dropped and dropped == {p.id for p in suite} & train  # seed 1: 4 of 180
    assert kept == [p for p in suite if p.id not in train]


def test_text_task_runs_are_scored_on_their_own_held_out_split_only():
    from factory.envs.eval_suites import applicable_benchmarks
    from factory.envs.tasks import make_task_splits

    assert applicable_benchmarks("arithmetic") == ["heldout", "carry_chains"]
    assert applicable_benchmarks("code") == applicable_benchmarks("word_problems") == ["heldout"]
    task = TaskSpec(name="word_problems", n_train=50, n_eval=10)
    splits = make_task_splits(task, 0)
    assert benchmark_problems("heldout", task, splits) == splits.eval
    with pytest.raises(ValueError, match="is an arithmetic suite; a word_problems run is scored on: heldout"):
        benchmark_problems("carry_chains", task, splits)
    assert "word_problems" not in suite_names() and "code_problems" not in suite_names()
    with pytest.raises(ValueError, match="depends on the run's data sources"):  # checkpoint_eval builds it
        benchmark_problems("humaneval", task, splits)
