"""The torch-free GPU counter and the check that refuses GPUs a machine does not have (factory/infra/gpus.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from factory.config import apply_overrides, load_spec
from factory.infra import gpus as gpus_mod
from factory.infra.gpus import Gpus, check_gpus, count_gpus

QUICKSTART = str(Path(__file__).parents[2] / "examples" / "quickstart.yaml")


def spec_with(**overrides):
    return apply_overrides(load_spec(QUICKSTART), overrides)


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """No /proc entry; a real `nvidia-smi` on PATH printing `text` (and exiting `rc`)."""
    def make(text: str, rc: int = 0) -> None:
        monkeypatch.setattr(gpus_mod, "PROC_GPUS", tmp_path / "absent")
        bindir = tmp_path / "bin"
        bindir.mkdir()
        script = bindir / "nvidia-smi"
        script.write_text(f"#!/bin/sh\ncat <<'X'\n{text}\nX\nexit {rc}\n")
        script.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return make


def test_proc_entries_are_counted(gpu_driver):
    gpu_driver(4)
    assert count_gpus({}) == Gpus(4, str(gpus_mod.PROC_GPUS))


def test_nvidia_smi_gpu_lines_are_counted_not_its_mig_lines(smi):
    smi("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1f2e)\n  MIG 1g.10gb Device 0: (UUID: MIG-aa)\n"
        "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-3c4d)")
    assert count_gpus({}) == Gpus(2, "nvidia-smi -L")


def test_failing_nvidia_smi_counts_none(smi):
    smi("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", rc=9)
    assert count_gpus({}).count == 0


def test_no_driver_counts_none(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus_mod, "PROC_GPUS", tmp_path / "absent")
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    got = count_gpus({})
    assert got.count == 0 and "no NVIDIA driver found" in got.source


@pytest.mark.parametrize(("setting", "want"), [
    ("", 0), ("  ", 0),            # set and empty: none
    ("1", 1), ("3,0", 2),          # indices
    ("0,7,1", 1),                  # CUDA stops at the first index the driver does not have
    ("-1", 0), ("0,-1,1", 1),      # the usual way to hide GPUs
    ("0,0", 1),                    # a repeat ends the list
    ("GPU-8a1b2c3d-0000-1111-2222-333344445555,MIG-1234", 2),  # UUIDs
    ("GPU-a,GPU-b,GPU-c,GPU-d,GPU-e", 4),  # never more than the driver shows
])
def test_cuda_visible_devices_narrows_the_driver_count(gpu_driver, setting, want):
    gpu_driver(4)
    assert count_gpus({"CUDA_VISIBLE_DEVICES": setting}).count == want


def test_cuda_visible_devices_without_a_driver_is_none(tmp_path, monkeypatch):
    monkeypatch.setattr(gpus_mod, "PROC_GPUS", tmp_path / "absent")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}).count == 0


def test_the_quickstart_and_cpu_layouts_need_no_gpu():
    assert spec_with().resolved.cuda_asked == ()
    for spec in (spec_with(), spec_with(**{"trainer.world_size": 2}), spec_with(**{"device": "cpu",
                                                                                   "trainer.world_size": 4})):
        check_gpus(spec, Gpus(0, "test"))  # device auto on a CPU machine: gloo ranks, valid
    check_gpus(spec_with(**{"device": "cpu", "trainer.world_size": 4}), Gpus(1, "test"))  # cpu asked: ranks on CPU


def test_world_size_above_the_gpu_count_is_refused_when_the_run_uses_cuda():
    with pytest.raises(ValueError, match=r"^trainer.world_size: 2 ranks, one GPU each, but this machine has 1 GPU "
                                         r"\(test\); use at most 1 ranks, or device: cpu"):
        check_gpus(spec_with(**{"trainer.world_size": 2}), Gpus(1, "test"))  # auto on a GPU machine uses CUDA
    check_gpus(spec_with(**{"trainer.world_size": 2}), Gpus(2, "test"))
    with pytest.raises(ValueError, match=r"^trainer.world_size: 4 ranks"):
        check_gpus(spec_with(**{"trainer.world_size": 4, "trainer.backend": "megatron"}), Gpus(2, "test"))


def test_gpu_lists_and_indices_the_machine_lacks_are_refused():
    with pytest.raises(ValueError, match=r"^trainer.devices: GPU 2 asked for \(got \[0, 2\]\), but this machine has "
                                         r"2 GPUs \(test\): indices 0..1"):
        check_gpus(spec_with(**{"trainer.world_size": 2, "trainer.devices": [0, 2]}), Gpus(2, "test"))
    with pytest.raises(ValueError, match=r"^device: GPU 3 asked for"):
        check_gpus(spec_with(**{"device": "cuda:3"}), Gpus(2, "test"))
    check_gpus(spec_with(**{"device": "cuda:1"}), Gpus(2, "test"))
    sglang = {"rollout.engine": "sglang", "rollout.sglang.servers": 2, "schedule.mode": "async"}
    with pytest.raises(ValueError, match=r"^rollout.devices: GPU 5 asked for \(got \[4, 5\]\)"):
        check_gpus(spec_with(**sglang, **{"rollout.devices": [4, 5]}), Gpus(5, "test"))
    with pytest.raises(ValueError, match=r"^rollout.sglang.tp_size: 2 GPUs per server, but this machine has 1 GPU"):
        check_gpus(spec_with(**sglang, **{"rollout.sglang.tp_size": 2}), Gpus(1, "test"))


@pytest.mark.parametrize(("overrides", "field"), [
    ({"device": "cuda"}, "device: cuda"),
    ({"trainer.devices": [0]}, "trainer.devices: [0]"),
    ({"trainer.backend": "megatron"}, "trainer.backend: megatron"),
    ({"rollout.engine": "sglang", "schedule.mode": "async", "rollout.devices": [0]}, "rollout.devices: [0]"),
])
def test_gpu_only_settings_on_a_machine_without_gpus_are_refused(overrides, field):
    with pytest.raises(ValueError, match=rf"^{__import__('re').escape(field)} needs a CUDA GPU, but this machine has "
                                         r"0 GPUs \(none here\)"):
        check_gpus(spec_with(**overrides), Gpus(0, "none here"))


def test_sglang_servers_already_running_elsewhere_need_no_local_gpu():
    spec = spec_with(**{"rollout.engine": "sglang", "schedule.mode": "async", "rollout.sglang.tp_size": 4,
                        "rollout.sglang.urls": ["http://10.0.0.2:30000"]})
    check_gpus(spec, Gpus(1, "test"))


def test_unplaced_sglang_servers_are_left_to_their_python_without_gpus():
    """`rollout.sglang.python` may start a CPU build or a stand-in (the fake server of the smoke benchmarks)."""
    check_gpus(spec_with(**{"rollout.engine": "sglang", "schedule.mode": "async"}), Gpus(0, "test"))
