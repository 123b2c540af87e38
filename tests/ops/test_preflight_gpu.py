"""The accelerator check on recorded nvidia-smi and kernel-log output (no GPU exists here): parsing, the verdict per
fault, and the whole path through a stand-in `nvidia-smi` executable that prints the recorded text."""

import os
import stat

import pytest

from factory.ops.preflight import NODE_KINDS, run_preflight
from factory.ops.preflight.gpu import (
    assess,
    parse_query_gpu,
    parse_remapped_rows,
    parse_xids,
    query_gpus,
    with_remaps,
)
from factory.ops.preflight.nodes import detect_kind

# `nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total,ecc.mode.current,ecc.errors.uncorrected.volatile.total,
# ecc.errors.corrected.volatile.total,retired_pages.pending,temperature.gpu --format=csv,noheader,nounits` on an
# 8 x H100 SXM node (Hopper reports row remapping instead of page retirement: retired_pages.pending is [N/A]).
H100X8 = """\
0, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559, Enabled, 0, 0, [N/A], 31
1, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 81559, Enabled, 0, 3, [N/A], 30
2, NVIDIA H100 80GB HBM3, 00000000:3A:00.0, 81559, Enabled, 0, 0, [N/A], 32
3, NVIDIA H100 80GB HBM3, 00000000:5D:00.0, 81559, Enabled, 0, 0, [N/A], 29
4, NVIDIA H100 80GB HBM3, 00000000:9A:00.0, 81559, Enabled, 0, 0, [N/A], 31
5, NVIDIA H100 80GB HBM3, 00000000:AB:00.0, 81559, Enabled, 0, 0, [N/A], 30
6, NVIDIA H100 80GB HBM3, 00000000:BA:00.0, 81559, Enabled, 0, 0, [N/A], 33
7, NVIDIA H100 80GB HBM3, 00000000:DB:00.0, 81559, Enabled, 0, 0, [N/A], 31
"""
# `nvidia-smi --query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure --format=csv,noheader,...`
REMAPS_OK = "".join(f"{line.split(', ')[2]}, 0, 0\n" for line in H100X8.splitlines())
REMAP_PENDING = REMAPS_OK.replace("00000000:5D:00.0, 0, 0", "00000000:5D:00.0, 1, 0")
REMAP_FAILED = REMAPS_OK.replace("00000000:9A:00.0, 0, 0", "00000000:9A:00.0, 0, Yes")
# dmesg after a GPU fell off the bus, with an application fault on another GPU earlier.
DMESG_XID79 = """\
[  512.000123] NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python, Graphics Exception: ESR 0x504648=0x2000d
[ 7001.314159] nvidia-nvlink: IBMNPU: device count 0
[86423.271828] NVRM: Xid (PCI:0000:2a:00): 79, pid=0, name=, GPU has fallen off the bus.
[86423.271901] NVRM: GPU 0000:2a:00.0: GPU has fallen off the bus.
"""
DMESG_APP_ONLY = DMESG_XID79.splitlines()[0] + "\n"
H100 = NODE_KINDS["gpu-h100x8"]


def verdict(query=H100X8, remaps=REMAPS_OK, dmesg="", kind=H100):
    gpus = with_remaps(parse_query_gpu(query), parse_remapped_rows(remaps))
    return assess(gpus, parse_xids(dmesg), min_gpus=kind.gpus, min_memory_mib=kind.gpu_memory_mib,
                  require_ecc=kind.ecc)


def test_healthy_h100_node_passes():
    gpus = parse_query_gpu(H100X8)
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[1].ecc_corrected == 3 and gpus[0].retired_pending is None and gpus[0].memory_mib == 81559
    assert detect_kind([g.name for g in gpus]) == "gpu-h100x8"
    r = verdict()
    assert r.passed and r.value == 8 and r.threshold == 8
    assert "8 x NVIDIA H100 80GB HBM3, 81559 MiB each" in r.message


def test_a_missing_gpu_fails_the_count_and_keeps_the_8_gpu_kind():
    seven = "".join(H100X8.splitlines(keepends=True)[:7])
    assert detect_kind([g.name for g in parse_query_gpu(seven)]) == "gpu-h100x8"  # not a kind that accepts 7
    r = verdict(seven)
    assert not r.passed and r.value == 7 and "7 GPUs visible, expected 8" in r.message


def test_a_pod_is_held_to_the_gpus_it_asked_for(monkeypatch):
    # a preflight Job asking for 4 of a node's 8 GPUs (FACTORY_EXPECTED_GPUS, set by factory deploy preflight)
    four = "".join(H100X8.splitlines(keepends=True)[:4])
    monkeypatch.setenv("FACTORY_EXPECTED_GPUS", "4")
    assert detect_kind([g.name for g in parse_query_gpu(four)]) == "gpu-h100x4"
    three = "".join(H100X8.splitlines(keepends=True)[:3])  # one of its 4 missing: still the 4-GPU kind
    assert detect_kind([g.name for g in parse_query_gpu(three)]) == "gpu-h100x4"
    monkeypatch.setenv("FACTORY_EXPECTED_GPUS", "four")
    with pytest.raises(ValueError, match="FACTORY_EXPECTED_GPUS: expected a GPU count of 1 or more, got 'four'"):
        detect_kind([g.name for g in parse_query_gpu(four)])


def test_uncorrected_ecc_errors_fail_naming_the_gpu():
    bad = H100X8.replace("3, NVIDIA H100 80GB HBM3, 00000000:5D:00.0, 81559, Enabled, 0, 0",
                         "3, NVIDIA H100 80GB HBM3, 00000000:5D:00.0, 81559, Enabled, 2, 0")
    r = verdict(bad)
    assert not r.passed and "GPU 3 (00000000:5d:00.0): 2 uncorrected ECC errors" in r.message


def test_ecc_disabled_fails_on_a_kind_that_requires_it():
    r = verdict(H100X8.replace("81559, Enabled", "81559, Disabled", 1))
    assert not r.passed and "GPU 0 (00000000:18:00.0): ECC disabled" in r.message


def test_row_remap_pending_and_failure_fail():
    r = verdict(remaps=REMAP_PENDING)
    assert not r.passed and "GPU 3 (00000000:5d:00.0): row remap pending (needs a reset)" in r.message
    r = verdict(remaps=REMAP_FAILED)
    assert not r.passed and "GPU 4 (00000000:9a:00.0): row remapping failed" in r.message


def test_hardware_xid_fails_application_xid_is_only_reported():
    assert [(x.device, x.code) for x in parse_xids(DMESG_XID79)] == [("PCI:0000:18:00", 13), ("PCI:0000:2a:00", 79)]
    r = verdict(dmesg=DMESG_XID79)
    assert not r.passed and "XID 79 (GPU has fallen off the bus) on PCI:0000:2a:00" in r.message
    r = verdict(dmesg=DMESG_APP_ONLY)
    assert r.passed and "application XIDs seen: [13]" in r.message


def test_malformed_output_names_the_line():
    with pytest.raises(ValueError, match=r"line 2: expected 9 fields"):
        parse_query_gpu(H100X8.splitlines()[0] + "\n0, NVIDIA H100\n")


def _fake_tools(tmp_path, query: str, remaps: str, dmesg: str, smi_exit: int = 0):
    """`nvidia-smi` and `dmesg` executables that print recorded output: the parts of a GPU node that cannot exist
    here. Everything else (the subprocess calls, parsing, the kind's floors, the runner) is the real code."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("query", "remaps", "dmesg"):
        (tmp_path / name).write_text({"query": query, "remaps": remaps, "dmesg": dmesg}[name])
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   + (f"echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
                      f"exit {smi_exit}\n" if smi_exit else "")
                   + f'case "$1" in --query-gpu=*) cat {tmp_path / "query"};; '
                     f'--query-remapped-rows=*) cat {tmp_path / "remaps"};; *) exit 2;; esac\n')
    (bin_dir / "dmesg").write_text(f"#!/bin/sh\ncat {tmp_path / 'dmesg'}\n")
    for f in (smi, bin_dir / "dmesg"):
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_gpu_node_end_to_end_through_nvidia_smi(tmp_path, factory_home, monkeypatch):
    monkeypatch.setenv("PATH", _fake_tools(tmp_path, H100X8, REMAP_PENDING, DMESG_XID79))
    gpus = query_gpus()
    assert len(gpus) == 8 and gpus[3].remap_pending is True
    report = run_preflight(factory_home, only=["accelerators", "matmul"], record=False)
    assert report.kind == "gpu-h100x8"
    acc, mm = report.results
    assert not acc.passed and "row remap pending" in acc.message and "XID 79" in acc.message
    # This torch is a CPU build: on a node whose nvidia-smi lists GPUs, that is a failure, not a CPU fallback.
    assert not mm.passed and "torch sees no CUDA device" in mm.message


def test_nvidia_smi_that_fails_fails_the_check(tmp_path, factory_home, monkeypatch):
    monkeypatch.setenv("PATH", _fake_tools(tmp_path, "", "", "", smi_exit=9))
    report = run_preflight(factory_home, only=["accelerators"], kind="gpu-h100x8", record=False)
    (acc,) = report.results
    assert not acc.passed and "nvidia-smi failed (exit 9)" in acc.message and "NVIDIA driver" in acc.message


def test_cpu_node_reports_no_accelerator_and_passes(factory_home, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi anywhere
    (acc,) = run_preflight(factory_home, only=["accelerators"], kind="cpu", record=False).results
    assert acc.passed and acc.message == "no accelerator (CPU node)" and acc.value == 0
