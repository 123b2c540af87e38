"""benchmarks/real_model.py's pieces that need no model: the reward (Factory's reasoning_gym verifier: the task's
own score_answer), the training and held-out rows, and reading the example spec. The learning run itself is a
benchmark, not a test."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
rm = importlib.import_module("benchmarks.real_model")
SOURCE = {"name": "cs", "kind": "reasoning_gym", "task": "chain_sum", "seed": 3, "size": 40,
          "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, "instruction": ""}


def test_reward_is_the_tasks_score_answer_on_the_extracted_answer() -> None:
    train, _ = rm.rg_rows(SOURCE, 5)
    p = train[0]
    assert p.meta["verifier"] == "reasoning_gym" and p.op == "reasoning_gym"
    assert rm.reward(p, p.answer) == 1.0
    assert rm.reward(p, f"<answer>{p.answer}</answer>") == 1.0
    assert rm.reward(p, f"The final answer to this arithmetic problem is {p.answer}.") == 1.0
    assert rm.reward(p, f"<answer>{int(p.answer) + 1}</answer> {p.answer}") == 0.0  # tags win
    assert rm.reward(p, str(int(p.answer) + 1)) == 0.0
    assert rm.reward(p, "I do not know") == 0.0


def test_held_out_rows_follow_the_training_rows_with_unseen_questions() -> None:
    train, held = rm.rg_rows(SOURCE, 20)
    assert len(train) == 40 and len(held) == 20
    assert {p.meta["rg_index"] for p in train} == set(range(40))
    assert min(p.meta["rg_index"] for p in held) >= 40
    questions = {p.prompt for p in train}
    assert not questions & {p.prompt for p in held}
    assert len({p.prompt for p in held}) == 20
    assert all(p.prompt.startswith("State the final answer") and p.prompt.endswith("=") for p in train + held)
    again, held_again = rm.rg_rows(SOURCE, 20)  # a pure function of the source: the same rows every time
    assert [p.prompt for p in again + held_again] == [p.prompt for p in train + held]


def test_example_spec_has_one_reasoning_gym_source_and_no_sft() -> None:
    raw, source, held_out = rm.load_spec_dict(ROOT / "examples" / "smollm2_reasoning.yaml", "/some/dir")
    assert source["kind"] == "reasoning_gym" and source["task"] == "chain_sum"
    assert held_out == 50 and "data" not in raw
    assert raw["model"]["path"] == "/some/dir" and raw["sft"]["steps"] == 0


def test_a_spec_without_a_reasoning_gym_source_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "s.yaml"
    bad.write_text("data:\n  sources:\n    - {name: a, kind: arithmetic, op: add, digits: 2, n: 10}\n")
    with pytest.raises(SystemExit, match="exactly one reasoning_gym source, got 0"):
        rm.load_spec_dict(bad, None)


def test_the_feed_the_benchmark_trains_from_keeps_each_rows_verifier() -> None:
    # the spec's default feed (no data section) files rows under the task section's family ("arithmetic"),
    # whose verifier scores every chain_sum reply 0: the benchmark passes its own feed
    from factory.data.feed import feed_of

    train, _ = rm.rg_rows(SOURCE, 5)
    _, drawn = feed_of(train, seed=0, name="cs").draw(0)
    assert drawn.meta["verifier"] == "reasoning_gym" and drawn.meta["source"] == "cs"
