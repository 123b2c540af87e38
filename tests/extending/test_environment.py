"""docs/extending.md's worked example "Adding an environment": a toy task family (tests/extending/toy_environment.py,
outside factory/) named in the spec by import path, by an in-process registration and by a plugin's entry point,
validated by the spec, and trained for a few steps of the micro model, whose recorded rewards are its verifier's."""

from __future__ import annotations

import pytest

from factory.config import SpecError, parse_spec
from factory.core.loop import train_rl
from factory.data.sources import JsonlSource
from factory.envs.tasks import make_task_splits, verify
from factory.models.build import policy_for
from factory.protocols import TASK_FAMILIES
from factory.source_spec import SourceError
from tests.extending import toy_environment

IMPORT_PATH = "tests.extending.toy_environment:FAMILY"


@pytest.fixture(autouse=True)
def _forget_the_toy():
    """Naming the family by import path registers it under its name, 'copy', in this process: forget it."""
    yield
    TASK_FAMILIES.unregister("copy")


def spec(name: str, steps: int = 3):
    return parse_spec({"seed": 0, "model": {"preset": "micro"}, "task": {"name": name, "n_train": 16, "n_eval": 8},
                       "algorithm": {"name": "grpo", "group_size": 4, "lr": 0.01},
                       "rollout": {"prompts_per_step": 2, "max_new_tokens": 5},
                       "trainer": {"threads": 1, "minibatches": 1}, "schedule": {"steps": steps}})


def test_toy_family_trains_and_its_verifier_scores_the_rewards():
    toy = toy_environment.FAMILY
    toy.verifier.scored.clear()
    s = spec(IMPORT_PATH)
    splits = make_task_splits(s.task, s.seed)
    assert len(splits.train) == 16 and splits.train[0].prompt.startswith("copy ")
    model, tok = policy_for(s)  # the micro preset, with the text tokenizer any family but arithmetic gets
    records = train_rl(s, model, tok, splits.train)
    assert [r.step for r in records] == [1, 2, 3]
    # Each sync step scores 2 prompts x 4 completions, all by the toy's verifier; each step's recorded reward mean
    # is the mean of the rewards it gave for that step, and they are graded (the arithmetic check gives only 0/1).
    per_step = 2 * 4
    scored = toy.verifier.scored
    assert len(scored) == 3 * per_step
    means = [sum(scored[i:i + per_step]) / per_step for i in range(0, len(scored), per_step)]
    assert [r.reward_mean for r in records] == pytest.approx(means, abs=1e-6)
    assert any(0.0 < x < 1.0 for x in scored) and all(r.hacks_any is None and r.env_errors == 0 for r in records)


def test_held_out_evals_use_the_toy_verifier():
    p = make_task_splits(spec(IMPORT_PATH).task, 0).eval[0]
    assert verify(p.answer, p) == 1.0 and verify(f"x{p.answer}", p) == pytest.approx(0.5 * 4 / 5)


def test_registered_in_process_and_validated_by_the_spec():
    TASK_FAMILIES.register("copy_inproc", toy_environment.CopyFamily(name="copy_inproc"))
    try:
        s = spec("copy_inproc")
        assert s.model_dump()["task"]["name"] == "copy_inproc"  # the spec keeps the name it was given
        p = make_task_splits(s.task, 0).train[0]
        assert p.op == "copy_inproc" and verify(p.answer, p) == 1.0
        with pytest.raises(ValueError, match="registered already"):
            TASK_FAMILIES.register("code", toy_environment.FAMILY)  # a plugin cannot shadow a built-in
    finally:
        TASK_FAMILIES.unregister("copy_inproc")
    with pytest.raises(SpecError, match=r"^invalid spec:\n  task.name: unknown task family 'copy_inproc'; one of "
                                        r"arithmetic, word_problems, code, or an import path"):
        spec("copy_inproc")


def test_registered_by_a_plugins_entry_point(installed_plugin):
    # An installed package declaring [project.entry-points."factory.task_families"] copy_ep = "...": its metadata.
    installed_plugin("factory.task_families", copy="tests.extending.toy_environment:FAMILY")
    assert "copy" in TASK_FAMILIES.names()
    p = make_task_splits(spec("copy").task, 0).eval[0]
    assert verify(p.answer, p) == 1.0


def test_a_data_source_names_a_registered_family_as_its_verifier(tmp_path, installed_plugin):
    # Prompts of one's own (a JSONL file) scored by a plugin's family: the rows take its name as op, so verify
    # dispatches them to its verifier.
    path = tmp_path / "copy.jsonl"
    path.write_text('{"prompt": "copy 4729=", "answer": "4729"}\n')
    with pytest.raises(SourceError, match=r"source 'mine': unknown verifier 'copy_src'; use one of .*arithmetic"):
        JsonlSource("mine", path, "copy_src")
    TASK_FAMILIES.register("copy_src", toy_environment.CopyFamily(name="copy_src"))
    try:
        row, = JsonlSource("mine", path, "copy_src").read_block(0)
        assert row.op == "copy_src" and row.meta["verifier"] == "copy_src"
        assert verify("4729", row) == 1.0 and verify("x4729", row) == pytest.approx(0.5 * 4 / 5)
    finally:
        TASK_FAMILIES.unregister("copy_src")
    installed_plugin("factory.task_families", copy_ep="tests.extending.toy_environment:FAMILY")
    try:
        row, = JsonlSource("mine", path, "copy_ep").read_block(0)  # checked by name: the plugin is not imported yet
        assert row.op == "copy_ep" and verify("4729", row) == 1.0
    finally:
        TASK_FAMILIES.unregister("copy_ep")  # the loaded plugin is cached under its name


def test_not_a_task_family_is_refused_when_named():
    with pytest.raises(SpecError, match=r"task.name 'math:pi': float is not a TaskFamily \(it needs name, verifier, "):
        spec("math:pi")
