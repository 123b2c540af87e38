"""The worked example of docs/extending.md, "Adding a rollout backend": the toy backend of `toy_rollout.py`, defined
outside `factory/` and registered through the public API (in-process, by import path in the spec, or as a plugin's
entry point), drives a few GRPO steps of the micro model, and what the run trained on are the toy's completions.

Every problem's answer is the empty string (as in tests/core/test_loop.py), so a completion is right exactly when
its first token is <eos>: rewards are mixed from the first step and every step really updates the weights."""

from __future__ import annotations

import json

import pytest
import torch

from factory.config import SpecError, parse_spec
from factory.core.loop import train_rl
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.problem import Problem
from factory.protocols import PRODUCERS
from tests.extending import toy_rollout

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(10)]
IMPORT_PATH = "tests.extending.toy_rollout:build"


def spec(engine: str, mode: str = "sync", steps: int = 3):
    return parse_spec({"seed": 0, "model": {"preset": "micro"}, "algorithm": {"group_size": 4, "lr": 0.01},
                       "rollout": {"engine": engine, "prompts_per_step": 4, "max_new_tokens": 3},
                       "trainer": {"threads": 1}, "schedule": {"mode": mode, "steps": steps}})


@pytest.fixture
def toy():
    PRODUCERS.register("toy", toy_rollout.build)
    yield "toy"
    PRODUCERS.unregister("toy")


@pytest.mark.parametrize(("how", "mode"), [("registered", "sync"), ("registered", "one_step_off"),
                                           ("import path", "sync")])
def test_the_toy_backend_drives_training_on_its_own_completions(toy, how, mode, tmp_path, monkeypatch):
    log = tmp_path / "toy.jsonl"
    monkeypatch.setenv("TOY_ROLLOUT_LOG", str(log))
    tok = build_tokenizer()
    model = build_model("micro", tok, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    records = train_rl(spec(toy if how == "registered" else IMPORT_PATH, mode), model, tok, PROBLEMS)

    assert [r.step for r in records] == [1, 2, 3]
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["published"] for e in entries if "published" in e] == [1, 2, 3]  # every version reached the toy
    sampled = {}  # weight version -> the texts the toy handed out under it
    for e in entries:
        if "completions" in e:
            sampled.setdefault(e["version"], []).extend(e["completions"])
    for r in records:  # the episodes a step trained on are completions the toy sampled under their version
        assert r.samples, r.step
        for s in r.samples:
            assert s["completion"] in sampled[s["weight_version"]], (r.step, s)
    # the toy's log-probs are the trainer's own (an exact engine): the measured sampler/trainer gap is ~0
    assert all(r.logprob_mismatch < 1e-4 for r in records), [r.logprob_mismatch for r in records]
    assert any(0 < r.reward_mean < 1 for r in records)  # mixed rewards: a real update, not zero advantages
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_plugins_entry_point_names_the_backend(installed_plugin):
    # A package's metadata, as `pip install` writes it from `[project.entry-points."factory.producers"]`.
    installed_plugin("factory.producers", toy_plugin=IMPORT_PATH)
    assert "toy_plugin" in PRODUCERS.names()
    assert PRODUCERS.get("toy_plugin") is toy_rollout.build
    assert spec("toy_plugin").rollout.engine == "toy_plugin"


def test_a_name_that_is_no_backend_fails_at_validation_naming_the_field():
    with pytest.raises(SpecError, match=r"rollout\.engine.*unknown rollout backend 'toy'.*embedded, server, sglang"):
        spec("toy")
    with pytest.raises(SpecError, match=r"rollout\.engine: '[\w.]+:__doc__' is no rollout backend.*got str"):
        spec("tests.extending.toy_rollout:__doc__")  # a string, not a builder
