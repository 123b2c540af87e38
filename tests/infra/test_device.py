"""The run's device: `device` resolved once (auto/cpu/cuda/cuda:N), checked against what the machine has."""

from __future__ import annotations

import pytest
import torch

from factory.config import ExperimentSpec, SpecError, parse_spec
from factory.infra import device as dev


def test_auto_is_the_cpu_without_cuda_and_the_default_keeps_old_fingerprints(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.run_device(ExperimentSpec().resolved) == torch.device("cpu")
    assert "device" not in ExperimentSpec().to_json()  # a late field: absent while it holds its default
    assert '"device": "cpu"' in ExperimentSpec(device="cpu").to_json()


def test_auto_and_cuda_pick_the_current_gpu_when_torch_sees_one(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert dev.resolve_device("auto") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda") == torch.device("cuda", 0)
    assert dev.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device: 'cuda:2' names GPU 2, but this machine shows 2"):
        dev.resolve_device("cuda:2")
    # A one-process trainer placed by trainer.devices is the run's device; a contradicting device is refused.
    assert dev.run_device(ExperimentSpec(trainer={"devices": [1]}).resolved) == torch.device("cuda", 1)
    # ... and a contradicting device is refused when the spec validates, wherever that is (config/resolved.py).
    with pytest.raises(SpecError, match=r"trainer.devices: \[1\] places the one trainer process on cuda:1"):
        parse_spec({"device": "cpu", "trainer": {"devices": [1]}})


def test_cuda_without_a_gpu_is_refused_by_name(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device: 'cuda' asks for CUDA, but torch sees no CUDA device"):
        dev.resolve_device("cuda")
    with pytest.raises(SpecError, match="device"):
        parse_spec({"device": "gpu"})


def test_cpu_habits_change_nothing() -> None:
    cpu = torch.device("cpu")
    dev.prepare(cpu)
    x = torch.ones(3)
    assert dev.to_host(x) is x
    with dev.autocast(cpu, "fp32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with dev.autocast(cpu, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert dev.describe(cpu).startswith("cpu (")
