"""`factory validate` refuses what this machine cannot hold (GPUs counted without torch, cores), as the run's start
would, naming the field; layouts that need no GPU stay valid on a CPU machine."""

from __future__ import annotations

import pytest

from factory.cli import main
from factory.infra import gpus as gpus_mod


def test_world_size_above_the_gpu_count_is_refused(gpu_driver, capsys):
    gpu_driver(1)
    assert main(["validate", "examples/quickstart.yaml", "--set", "trainer.world_size=2"]) == 2
    err = capsys.readouterr().err
    assert "trainer.world_size: 2 ranks, one GPU each, but this machine has 1 GPU" in err and "device: cpu" in err


def test_cuda_visible_devices_is_honoured(gpu_driver, monkeypatch, capsys):
    gpu_driver(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert main(["validate", "examples/quickstart.yaml", "--set", "trainer.world_size=2",
                 "--set", "trainer.devices=[0,1]"]) == 2
    assert "trainer.devices: GPU 1 asked for (got [0, 1]), but this machine has 1 GPU (CUDA_VISIBLE_DEVICES='2'" \
        in capsys.readouterr().err
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["validate", "examples/quickstart.yaml", "--set", "device=cuda"]) == 2
    assert "device: cuda needs a CUDA GPU, but this machine has 0 GPUs (CUDA_VISIBLE_DEVICES is set and empty)" \
        in capsys.readouterr().err


def test_a_two_rank_cpu_run_stays_valid(gpu_driver, capsys):
    gpu_driver(0)
    assert main(["validate", "examples/quickstart.yaml", "--set", "trainer.world_size=2"]) == 0
    gpus_mod.PROC_GPUS.joinpath("0000:00:00.0").mkdir()  # now one GPU: the spec asking for the CPU stays valid
    assert main(["validate", "examples/quickstart.yaml", "--set", "trainer.world_size=2", "--set", "device=cpu"]) == 0
    assert "ok (fingerprint" in capsys.readouterr().out


def test_cores_the_process_lacks_are_refused(gpu_driver, capsys):
    gpu_driver(0)
    assert main(["validate", "examples/quickstart.yaml", "--set", "rollout.cpus=[0,4096]"]) == 2
    assert "rollout.cpus: cores [4096] are not available to this process" in capsys.readouterr().err


def test_the_runs_start_refuses_gpus_torch_does_not_see():
    """The run's start counts with torch (the CPU build here sees none), before any model is built."""
    from factory.config import apply_overrides, load_spec
    from factory.runs.stages import set_threads

    spec = apply_overrides(load_spec("examples/quickstart.yaml"), {"device": "cuda:0"})
    with pytest.raises(ValueError, match=r"device: cuda:0 needs a CUDA GPU, but this machine has 0 GPUs "
                                         r"\(torch.cuda.device_count\(\)\)"):
        set_threads(spec, log=lambda _: None)
