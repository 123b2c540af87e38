"""Trainer backends as an extension point: every trainer class conforms to `factory.protocols.Trainer`, `make_trainer`
builds through `TRAINERS` (no if/elif on the backend), `trainer.backend` is validated against the registry, and the
non-finite rule is one function (`trainer/step.py`'s `guarded_step`) that every trainer calls.
(A toy backend from outside factory/, trained end to end: tests/extending/test_trainer_backend.py; Megatron's
conformance: tests/core/test_megatron.py.)"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from factory.config import load_spec, parse_spec
from factory.core import algorithms
from factory.core.trainer import distributed, step, torch_trainer
from factory.core.trainer.distributed import DistributedTrainer
from factory.core.trainer.ranks import LeaderTrainer, make_trainer, torch_backend
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer
from factory.protocols import TRAINERS, Trainer
from factory.protocols.trainer import trainer_problems
from tests.core.host_sync import NoHostCopy, NoHostSync
from tests.core.step_cases import GRPO, rl_batch

REPO = Path(__file__).resolve().parents[2]
BASE = {"model": {"preset": "micro"}, "algorithm": {"group_size": 2}, "rollout": {"prompts_per_step": 2}}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def micro(tok):
    return build_model("micro", tok, seed=0)


# ---------------------------------------------------------------- the protocol


def test_every_torch_trainer_class_conforms_to_the_protocol(tok):
    """TorchTrainer, a lone DistributedTrainer and rank 0's LeaderTrainer (around one) are `Trainer`s: the members
    the run calls, with the parameters it passes (MegatronTrainer: tests/core/test_megatron.py)."""
    lone = DistributedTrainer(micro(tok), lr=1e-3, grad_accum=2)
    for trainer in (TorchTrainer(micro(tok), lr=1e-3), lone, LeaderTrainer(lone)):
        assert isinstance(trainer, Trainer), type(trainer)
        assert trainer_problems(trainer) == [], type(trainer)


def test_trainer_problems_names_what_a_trainer_lacks():
    class NoOptimizer:
        version = 0

        def step(self, batch, loss_fn, minibatches=1, generator=None):
            return {}

        def logprobs(self, batch):
            return torch.zeros(0)

    class WrongStep(NoOptimizer):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

        def step(self, batch, loss, minibatches=2, *, seed):  # the wrong signature under test
            return {}

    assert not isinstance(NoOptimizer(), Trainer)
    assert trainer_problems(NoOptimizer()) == ["no attribute optimizer"]
    assert isinstance(WrongStep(), Trainer)  # runtime_checkable sees names only; trainer_problems reads signatures
    assert trainer_problems(WrongStep()) == [
        "step() has no parameter loss_fn", "step(): minibatches defaults to 2, not 1",
        "step() has no parameter generator", "step() requires loss, which the run does not pass",
        "step() requires seed, which the run does not pass"]


# ---------------------------------------------------------------- the registry and make_trainer


def test_the_builtins_are_torch_and_megatron_and_make_trainer_builds_through_the_registry(tok):
    assert TRAINERS.builtin_names() == ("torch", "megatron")
    assert TRAINERS.get("torch") is torch_backend
    spec = parse_spec(BASE)
    assert type(make_trainer(spec, micro(tok))) is TorchTrainer

    built = []

    def build(spec, model):
        built.append(TorchTrainer(model, lr=spec.algorithm.lr))
        return built[-1]

    TRAINERS.register("test_backend", build)
    try:
        spec = parse_spec({**BASE, "trainer": {"backend": "test_backend"}})
        assert make_trainer(spec, micro(tok)) is built[0]
    finally:
        TRAINERS.unregister("test_backend")


def test_make_trainer_refuses_a_builder_that_returns_no_trainer(tok):
    TRAINERS.register("not_a_trainer", lambda spec, model: object())
    try:
        spec = parse_spec({**BASE, "trainer": {"backend": "not_a_trainer"}})
        with pytest.raises(TypeError, match=r"^trainer.backend 'not_a_trainer': the builder returned a object, not a "
                                            r"factory.protocols.Trainer: no attribute version; no attribute optimizer; "
                                            r"no method step; no method logprobs$"):
            make_trainer(spec, micro(tok))
    finally:
        TRAINERS.unregister("not_a_trainer")


# ---------------------------------------------------------------- trainer.backend in the spec


def test_an_unknown_backend_is_one_line_naming_the_field_and_the_known_names():
    with pytest.raises(ValueError) as e:
        parse_spec({"trainer": {"backend": "torhc"}})
    (line,) = [x for x in str(e.value).splitlines() if "trainer.backend" in x]
    assert line.strip() == ("trainer.backend: unknown trainer backend 'torhc'; one of torch, megatron, or an import "
                            "path 'package.module:attr' (or a plugin's entry point in group 'factory.trainers')")
    with pytest.raises(ValueError, match=r"trainer.backend: cannot import 'nope' from 'factory.core.trainer.ranks'"):
        parse_spec({"trainer": {"backend": "factory.core.trainer.ranks:nope"}})
    with pytest.raises(ValueError, match=r"trainer.backend: 'factory.protocols:TRAINERS' is not a builder \(spec, "
                                         r"model\) -> Trainer but a Registry"):
        parse_spec({"trainer": {"backend": "factory.protocols:TRAINERS"}})


def test_the_quickstart_spec_dumps_and_fingerprints_as_before():
    spec = load_spec(REPO / "examples/quickstart.yaml")
    assert spec.fingerprint() == "96eec83d19b10919"
    assert spec.model_dump(mode="json")["trainer"]["backend"] == "torch"
    megatron = parse_spec({"trainer": {"backend": "megatron", "tensor_parallel": 2, "world_size": 2}})
    assert megatron.model_dump(mode="json")["trainer"]["backend"] == "megatron"


def test_validating_a_builtin_name_imports_no_backend():
    """A spec naming megatron validates without megatron-core or torch being imported (a built-in name is checked
    by membership): loading a spec stays light, and a machine without the extra can still validate it."""
    code = ("import sys; from factory.config import parse_spec; "
            "parse_spec({'trainer': {'backend': 'megatron'}}); "
            "print(sorted(m for m in ('torch', 'megatron', 'factory.core.trainer.megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------- the non-finite rule, in one place


def _params_and_adamw(fused: bool) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    opt = step.make_adamw(layer.parameters(), lr=0.1, weight_decay=0.0, fused=fused)
    layer(torch.randn(2, 4)).sum().backward()
    opt.step()  # moments and a step count to protect
    return layer, opt


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bad", [None, "loss", "grad_norm"])
def test_guarded_step_skips_a_nonfinite_update_bit_exact(fused, bad):
    layer, opt = _params_and_adamw(fused)
    before = copy.deepcopy((layer.state_dict(), opt.state_dict()["state"]))
    loss = layer(torch.randn(2, 4)).sum()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    loss = loss * float("nan") if bad == "loss" else loss
    grad_norm = grad_norm * float("inf") if bad == "grad_norm" else grad_norm
    if fused:
        with NoHostSync(), NoHostCopy():  # decided on the device: no host read
            applied = step.guarded_step(opt, loss, grad_norm, on_device=True)
        assert isinstance(applied, torch.Tensor) and applied.item() == (bad is None)
        assert all(p.grad is None for p in layer.parameters())  # dropped either way
    else:
        applied = step.guarded_step(opt, loss, grad_norm, on_device=False)
        assert applied is (bad is None)
    moved = any(not torch.equal(v, before[0][k]) for k, v in layer.state_dict().items())
    assert moved is (bad is None)
    if bad is not None:
        assert all(torch.equal(v, before[1][i][n]) for i, s in opt.state_dict()["state"].items() for n, v in s.items())


@pytest.mark.parametrize("make", ["torch", "torch_fused", "distributed", "distributed_fused"])
def test_every_trainer_applies_the_rule_through_guarded_step(tok, monkeypatch, make):
    """The trainers hold no skip logic of their own: each minibatch's update goes through `guarded_step`, the
    device-side form where the optimizer is fused (spied on here: the real function runs)."""
    calls = []

    def spy(optimizer, loss, grad_norm, *, on_device):
        calls.append(on_device)
        return step.guarded_step(optimizer, loss, grad_norm, on_device=on_device)

    fused = "on" if make.endswith("fused") else "off"
    if make.startswith("torch"):
        monkeypatch.setattr(torch_trainer, "guarded_step", spy)
        trainer = TorchTrainer(micro(tok), lr=1e-3, fused_optimizer=fused)
    else:
        monkeypatch.setattr(distributed, "guarded_step", spy)
        trainer = DistributedTrainer(micro(tok), lr=1e-3, grad_accum=2, fused_optimizer=fused)
    m = trainer.step(rl_batch(tok, 4, 9, seed=3), GRPO, minibatches=2, generator=torch.Generator().manual_seed(0))
    assert calls == [fused == "on"] * 2 and m["nonfinite"] == 0.0 and trainer.version == 2


def test_the_loss_functions_reach_the_rule_unchanged(tok):
    """A NaN from the algorithm's own loss skips the update in both trainers alike (the rule sees the loss the
    loss function returned)."""
    loss_fn = algorithms.make_loss(parse_spec(BASE).algorithm.for_rollout(9))

    def nan_loss(logp, batch):
        loss, metrics = loss_fn(logp, batch)
        return loss * float("nan"), metrics

    for trainer in (TorchTrainer(micro(tok), lr=1e-3), DistributedTrainer(micro(tok), lr=1e-3, grad_accum=2)):
        m = trainer.step(rl_batch(tok, 4, 9, seed=3), nan_loss)
        assert m["nonfinite"] == 1.0 and trainer.version == 0, type(trainer)
