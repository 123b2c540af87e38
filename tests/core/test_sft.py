"""SFT takes the run's trainer switches (trainer.packing and the others), as the RL trainer does."""

from __future__ import annotations

import pytest
import torch

from factory.config import SFTSpec, TaskSpec
from factory.core.sft import run_sft
from factory.envs.tasks import make_task_splits
from factory.models.build import build_model
from factory.models.tokenizer import tokenizer_for


def _sft(speedups: dict[str, str] | None) -> dict[str, torch.Tensor]:
    tok = tokenizer_for("arithmetic")
    model = build_model("micro", tok, seed=0)
    train = make_task_splits(TaskSpec(n_train=16, n_eval=8), 0).train
    run_sft(model, tok, train, SFTSpec(steps=2, batch_size=8, lr=1e-3), seed=0, speedups=speedups)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sft_passes_the_switches_to_its_trainer() -> None:
    with pytest.raises(ValueError, match="trainer.packing"):
        _sft({"packing": "sometimes"})
    auto = _sft(None)
    off = _sft({"packing": "off", "fused_head": "off", "compile": "off", "fused_optimizer": "off"})
    fused = _sft({"fused_optimizer": "on"})
    assert all(torch.equal(auto[k], off[k]) for k in auto)  # auto on the CPU is the old path, bit for bit
    assert any(not torch.equal(auto[k], fused[k]) for k in auto)  # the fused AdamW reached SFT's trainer
    assert all(torch.allclose(auto[k], fused[k], atol=1e-5) for k in auto)
