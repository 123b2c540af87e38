"""docs/extending.md, "Adding a trainer backend": the toy backend of tests/extending/toy_trainer.py, defined outside
factory/, registered through the public API (in process, as a plugin's entry point, as an import path in the spec)
and trained on the quickstart's micro model for 2 steps: by the RL loop a notebook calls (seconds), and by
`factory run` end to end (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from factory.cli import main
from factory.config import apply_overrides, load_spec, parse_spec
from factory.core.loop import train_rl
from factory.models.build import policy_for
from factory.problem import Problem
from factory.protocols import TRAINERS, Trainer
from factory.protocols.trainer import trainer_problems
from tests.extending import toy_trainer

# The quickstart, cut down to seconds: the micro model, a few problems, 2 RL steps (trainer.minibatches 2: 4 updates).
TINY = {"name": "toy-backend", "model.preset": "micro", "task.n_train": 64, "task.n_eval": 8, "sft.steps": 2,
        "sft.stop_at_accuracy": None, "rollout.prompts_per_step": 2, "algorithm.group_size": 2, "schedule.steps": 2,
        "schedule.eval_pass_k": 1}
# Answer "": a completion is right exactly when it starts with <eos>, so a random model's rewards are mixed at once
# (as in tests/core/test_loop.py) and its updates are not zero.
PROBLEMS = [Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer="", op="add", digits=1) for i in range(8)]


@pytest.fixture
def toy_registered():
    TRAINERS.register("toy_sgd", toy_trainer.build)
    toy_trainer.BUILT.clear()
    yield
    TRAINERS.unregister("toy_sgd")


def test_the_toy_backend_trains_the_quickstart_micro_model_for_two_steps(toy_registered):
    spec = apply_overrides(load_spec("examples/quickstart.yaml"), {**TINY, "trainer.backend": "toy_sgd",
                                                                   "algorithm.group_size": 8})
    model, tokenizer = policy_for(spec)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    records = train_rl(spec, model, tokenizer, PROBLEMS)
    (trainer,) = toy_trainer.BUILT  # the run's trainer was the toy's
    assert trainer.model is model and trainer.version == 2 * 2  # 2 steps of 2 minibatches, every update applied
    assert [r.step for r in records] == [1, 2] and all(r.nonfinite == 0.0 for r in records)
    assert any(r.reward_std > 0 for r in records)
    assert any(not torch.equal(v, start[k]) for k, v in model.state_dict().items())  # what the run publishes moved


@pytest.mark.slow
def test_the_toy_backend_trains_the_quickstart_model_through_factory_run(factory_home, capsys, toy_registered):
    """Dataset, SFT, the RL run and its records, in this process (21-36 s measured on the shared 2-core machine,
    load average 10-11)."""
    sets = [arg for k, v in {**TINY, "trainer.backend": "toy_sgd"}.items()
            for arg in ("--set", f"{k}={'null' if v is None else v}")]
    assert main(["run", "examples/quickstart.yaml", *sets, "--in-process"]) == 0
    (trainer,) = toy_trainer.BUILT  # the run's trainer was the toy's
    assert isinstance(trainer, Trainer) and trainer_problems(trainer) == []
    assert trainer.version == 2 * 2  # 2 steps of 2 minibatches, every update applied
    capsys.readouterr()
    assert main(["runs", "--format", "json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert run["status"] == "succeeded" and run["final_step"] == 2
    assert main(["query", f"SELECT spec FROM runs WHERE run_id = '{run['run_id']}'", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert json.loads(row["spec"])["trainer"]["backend"] == "toy_sgd"


def test_the_toy_registers_in_process_as_an_entry_point_and_as_an_import_path(installed_plugin, toy_registered):
    assert parse_spec({"trainer": {"backend": "toy_sgd"}}).trainer.backend == "toy_sgd"
    assert TRAINERS.get("toy_sgd") is toy_trainer.build
    assert "toy_sgd" in TRAINERS.names()
    # A plugin package: its entry point in group factory.trainers (what `pip install` of a package declaring
    # [project.entry-points."factory.trainers"] toy_ep = "tests.extending.toy_trainer:build" writes).
    installed_plugin("factory.trainers", toy_ep="tests.extending.toy_trainer:build")
    assert parse_spec({"trainer": {"backend": "toy_ep"}}).trainer.backend == "toy_ep"
    assert TRAINERS.get("toy_ep") is toy_trainer.build
    # No registration at all: the import path in the spec.
    path = "tests.extending.toy_trainer:build"
    assert parse_spec({"trainer": {"backend": path}}).trainer.backend == path
    assert TRAINERS.get(path) is toy_trainer.build


def test_the_guide_shows_the_toy_as_it_is():
    """docs/extending.md's worked example is this toy's code (after its docstring), so the guide cannot drift."""
    root = Path(__file__).resolve().parents[2]
    guide = (root / "docs/extending.md").read_text()
    section = guide[guide.index("## Adding a trainer backend"):]
    shown = section[section.index("```python\n") + len("```python\n"):]
    shown = shown[:shown.index("```\n")]
    assert shown == Path(toy_trainer.__file__).read_text().split('"""\n\n', 1)[1]
