"""The SFT warm start reports its progress with the early stop it may take, so its ETA reads as a bound."""

from __future__ import annotations

import torch

from factory.config import parse_spec
from factory.problem import Problem, Splits
from factory.progress import Progress
from factory.runs.stages import train_sft_checkpoint

torch.set_num_threads(1)

PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer=str(2 * i), op="add", digits=1) for i in range(12)]
SPLITS = Splits(train=PROBLEMS[:8], eval=PROBLEMS[8:])


def _spec(stop_at_accuracy: float | None):
    return parse_spec({"name": "sft-eta", "model": {"preset": "micro"}, "trainer": {"threads": 1},
                       "sft": {"steps": 3, "batch_size": 4, "stop_at_accuracy": stop_at_accuracy,
                               "check_every": 50},
                       "rollout": {"max_new_tokens": 2}, "schedule": {"eval_pass_k": 1},
                       "ops": {"preflight": "off"}})


def test_sft_progress_says_it_may_stop_early(factory_home):
    seen: list[Progress] = []
    train_sft_checkpoint(_spec(0.9), factory_home, SPLITS, log=lambda _: None, progress=seen.append)
    assert [p.step for p in seen] == [1, 2, 3] and {p.steps for p in seen} == {3}
    assert seen[0].stops_at_accuracy == 0.9 and "(stops early at accuracy 0.9)" in seen[0].tags()["eta"]


def test_sft_without_an_early_stop_shows_a_plain_eta(factory_home):
    seen: list[Progress] = []
    train_sft_checkpoint(_spec(None), factory_home, SPLITS, log=lambda _: None, progress=seen.append)
    assert seen and all(p.stops_at_accuracy is None for p in seen)
    assert "≤" not in seen[0].tags()["eta"]
