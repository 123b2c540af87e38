"""The torch trainer: a minibatch with a non-finite loss or gradient is skipped, leaving the parameters and the
AdamW state bit-exact, and the next finite step trains as usual."""

import copy

import pytest
import torch

from factory.core.batch import TrainBatch, pack
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer


class InfGrad(torch.autograd.Function):
    """Identity forward, infinite gradient backward: a finite loss whose gradients are not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def finite_loss(logp: torch.Tensor, batch: TrainBatch):
    return -(logp * batch.loss_mask).sum() / batch.loss_mask.sum(), {}


def nan_loss(logp: torch.Tensor, batch: TrainBatch):
    loss, m = finite_loss(logp, batch)
    return loss * float("nan"), m


def inf_grad_loss(logp: torch.Tensor, batch: TrainBatch):
    loss, m = finite_loss(logp, batch)
    return InfGrad.apply(loss), m


@pytest.fixture(params=["off", "on"], ids=["host_skip", "fused_device_skip"])
def trainer_and_batch(request):
    """A trainer whose skip is decided on the host (the CPU default), or on the device (trainer.fused_optimizer)."""
    tok = build_tokenizer()
    trainer = TorchTrainer(build_model("micro", tok, seed=0), lr=0.01, fused_optimizer=request.param)
    ids = [tok(t).input_ids for t in ("12+30=", "7+8=", "99+1=", "5+5=")]
    batch = pack(ids, [tok(t).input_ids for t in ("42", "15", "001", "01")], tok.pad_token_id)
    return trainer, batch


def snapshot(trainer: TorchTrainer) -> tuple[list[torch.Tensor], dict]:
    return ([p.detach().clone() for p in trainer.model.parameters()],
            copy.deepcopy(trainer.optimizer.state_dict()))


def assert_same(a: tuple[list[torch.Tensor], dict], b: tuple[list[torch.Tensor], dict]) -> None:
    params_a, opt_a = a
    params_b, opt_b = b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for k, state in opt_a["state"].items():
        assert state.keys() == opt_b["state"][k].keys()
        assert all(torch.equal(v, opt_b["state"][k][n]) for n, v in state.items()), k


@pytest.mark.parametrize("bad", [nan_loss, inf_grad_loss], ids=["nan_loss", "inf_grad"])
def test_a_nonfinite_step_leaves_parameters_and_adamw_state_bit_exact(trainer_and_batch, bad):
    trainer, batch = trainer_and_batch
    first = trainer.step(batch, finite_loss)  # AdamW has moments and a step count to protect
    assert first["nonfinite"] == 0.0 and trainer.version == 1
    before = snapshot(trainer)

    m = trainer.step(batch, bad)

    assert m["nonfinite"] == 1.0
    if bad is nan_loss:
        assert torch.isnan(torch.tensor(m["loss"]))
    else:
        assert torch.isfinite(torch.tensor(m["loss"])) and not torch.isfinite(torch.tensor(m["grad_norm"]))
    assert_same(before, snapshot(trainer))
    assert all(p.grad is None for p in trainer.model.parameters())  # nothing left to leak into the next step
    assert trainer.version == 1  # no optimizer step was taken

    after = trainer.step(batch, finite_loss)  # training goes on from the untouched state
    assert after["nonfinite"] == 0.0 and trainer.version == 2
    assert torch.isfinite(torch.tensor([after["loss"], after["grad_norm"]])).all()
    moved = snapshot(trainer)
    assert any(not torch.equal(x, y) for x, y in zip(before[0], moved[0], strict=True))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert int(moved[1]["state"][0]["step"]) == 2


def test_the_skipped_step_matches_never_having_seen_the_bad_batch(trainer_and_batch):
    trainer, batch = trainer_and_batch
    twin = copy.deepcopy(trainer)
    trainer.step(batch, finite_loss)
    trainer.step(batch, nan_loss)
    trainer.step(batch, finite_loss)
    twin.step(batch, finite_loss)
    twin.step(batch, finite_loss)
    assert_same(snapshot(trainer), snapshot(twin))


def test_with_minibatches_each_is_decided_alone_and_the_fraction_reported(trainer_and_batch):
    trainer, batch = trainer_and_batch
    calls = []

    def second_is_nan(logp, mb):
        calls.append(1)
        loss, m = finite_loss(logp, mb)
        return (loss * float("nan") if len(calls) == 2 else loss), m

    before = snapshot(trainer)
    m = trainer.step(batch, second_is_nan, minibatches=2, generator=torch.Generator().manual_seed(0))
    assert len(calls) == 2 and m["nonfinite"] == 0.5
    assert trainer.version == 1  # the first minibatch was applied, the second was not
    assert int(trainer.optimizer.state_dict()["state"][0]["step"]) == 1
    assert any(not torch.equal(x, y) for x, y in zip(before[0], snapshot(trainer)[0], strict=True))
