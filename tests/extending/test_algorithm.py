"""docs/extending.md's worked example: a toy algorithm (tests/extending/toy_algorithm.py, outside factory/) named in
the spec by import path, by an in-process registration and by a plugin's entry point, validated by the spec, and
trained for a few steps of the micro model, whose recorded losses are the toy's."""

from __future__ import annotations

import pytest
import torch

from factory.config import SpecError, parse_spec
from factory.core.algorithms import compute_advantages
from factory.core.loop import train_rl
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem
from factory.protocols import ALGORITHMS
from tests.extending import toy_algorithm

IMPORT_PATH = "tests.extending.toy_algorithm:ALGORITHM"
PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(4)]


def spec(name: str, **algorithm):
    return parse_spec({"seed": 0, "model": {"preset": "micro"},
                       "algorithm": {"name": name, "group_size": 8, "lr": 0.01, **algorithm},
                       "rollout": {"prompts_per_step": 4, "max_new_tokens": 3},
                       "trainer": {"threads": 1, "minibatches": 1}, "schedule": {"steps": 3}})


def test_toy_trains_and_its_loss_is_the_one_used():
    toy = toy_algorithm.ALGORITHM
    toy.losses.clear()
    s = spec(IMPORT_PATH)
    assert s.algorithm.implementation() is toy
    assert s.algorithm.aggregation() == "token_mean" and not s.algorithm.scales_rewards()  # its defaults
    tok = build_tokenizer()
    records = train_rl(s, build_model("micro", tok, seed=0), tok, PROBLEMS)
    assert [r.step for r in records] == [1, 2, 3]
    # One minibatch a step: each step's recorded loss is the one the toy returned (mixed rewards: not 0), and its
    # clip_frac the toy's 0.
    assert len(toy.losses) == 3 and all(x.item() != 0 for x in toy.losses)
    assert [r.loss for r in records] == [x.item() for x in toy.losses]
    assert all(r.clip_frac == 0.0 and r.nonfinite == 0.0 for r in records)


def test_toy_advantages_and_validation_are_its_own():
    s = spec(IMPORT_PATH).algorithm
    adv = compute_advantages(s, torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, torch.tensor([1, 2, 3, 3]))
    # reward minus the mean of the group's others (GRPO's default here would be 0.75, -0.25, ...)
    assert adv.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3], abs=1e-12)
    with pytest.raises(SpecError, match=r"^invalid spec:\n  algorithm.kl_coef: rloo has no KL term; leave it 0$"):
        spec(IMPORT_PATH, kl_coef=0.1)


def test_registered_in_process():
    ALGORITHMS.register("rloo", toy_algorithm.ALGORITHM)
    try:
        s = spec("rloo")
        assert s.algorithm.implementation() is toy_algorithm.ALGORITHM
        assert s.algorithm.model_dump()["name"] == "rloo"  # the spec keeps the name it was given
        assert "rloo" in ALGORITHMS.names()
        with pytest.raises(ValueError, match="registered already"):
            ALGORITHMS.register("grpo", toy_algorithm.ALGORITHM)  # a plugin cannot shadow a built-in
    finally:
        ALGORITHMS.unregister("rloo")
    with pytest.raises(SpecError, match=r"algorithm.name: unknown algorithm 'rloo'; one of grpo, dr_grpo, dapo, "
                                        r"cispo, gspo, or an import path"):
        spec("rloo")


def test_registered_by_a_plugins_entry_point(installed_plugin):
    # An installed package declaring [project.entry-points."factory.algorithms"] rloo = "...": its metadata.
    installed_plugin("factory.algorithms", rloo_ep=IMPORT_PATH)
    assert "rloo_ep" in ALGORITHMS.names()
    assert spec("rloo_ep").algorithm.implementation() is toy_algorithm.ALGORITHM


def test_not_an_algorithm_is_refused_when_named():
    with pytest.raises(SpecError, match=r"algorithm.name 'math:pi': 3.14\d+ is not an Algorithm \(no name, defaults, "
                                        r"loss\)"):
        spec("math:pi")
    with pytest.raises(SpecError, match=r"is a class; register an instance of it"):
        spec("tests.extending.toy_algorithm:RLOO")
