"""benchmarks/gpu/check.py (the device check) keeps working on the CPU: its `--smoke` mode runs every part's code
path with tiny shapes, a failing part is recorded without stopping the others, and benchmarks/gpu/lakeless.py
stands in for a lake library only where it is absent."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu" / "check.py"
PARTS = ("trainer", "publish", "engine", "logprobs", "megatron_trainer", "grpo")


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_runs_every_part_and_prints_one_json_line(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(CHECK), "--smoke", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    r = json.loads(line)
    assert json.loads(out.read_text()) == r  # the file holds the same line
    assert r["smoke"] is True and r["device"].startswith("cpu") and "numbers mean nothing" in r["note"]
    assert r["gpu_count"]["torch"] == r["gpu_count"]["factory"] == 0  # the CPU build of torch here sees none
    for part in PARTS:
        assert not {"error", "device_error", "cpu_error", "skipped"} & set(r[part]), (part, r[part])
    g = r["grpo"]
    assert g["grpo_steps"] == 2 and g["device_steps_per_s"] > 0 and g["cpu_steps_per_s"] > 0
    assert {"sft_accuracy", "device_accuracy", "cpu_accuracy", "same_band", "band_abs"} <= set(g)
    assert r["trainer"]["tokens_per_s"] > 0 and r["trainer"]["mfu"] is None  # MFU only on a GPU
    assert r["megatron_trainer"]["tokens_per_s"] > 0
    assert r["engine"]["engine_tokens_per_s"] > 0 and r["engine"]["generate_tokens_per_s"] > 0
    p = r["publish"]
    assert p["bit_exact"] is True and p["dtype"] == "bf16" and 0 < p["delta_mb"] < p["full_mb"]
    assert r["logprobs"]["precision"] == "fp32" and r["logprobs"]["max_abs_diff"] < 1e-4  # fp32 on the CPU


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # main sets 1 thread: not this test process's
    check = load_check()

    def broken(*_a, **_k):
        raise RuntimeError("engine broke")

    monkeypatch.setattr(check, "part_engine", broken)
    out = tmp_path / "c.json"
    assert check.main(["--smoke", "--parts", "engine,publish", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["engine"]["error"].startswith("RuntimeError: engine broke")
    assert r["publish"]["bit_exact"] is True  # publish built its own trainer: the trainer part was not asked for
    assert "trainer" not in r and "grpo" not in r
    assert "engine error: RuntimeError: engine broke" in capsys.readouterr().out


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit):
        load_check().main(["--smoke", "--parts", "trainer,warp"])


def test_lakeless_stands_in_only_for_absent_libraries(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import lakeless
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "gpu"))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(lakeless, "ABSENT_OK", ("json", "factory_kit_absent_lib"))
    assert lakeless.install() == ["factory_kit_absent_lib"]  # json is real: left alone
    from factory_kit_absent_lib.io.pyarrow import ArrowScan  # what the Iceberg source imports, say

    scan = ArrowScan(1, table="t")  # inert: takes anything, answers anything
    assert list(scan.to_table()) == [] and type(scan.schema["x"]).__name__ == "_Inert"
    sys.modules.pop("factory_kit_absent_lib", None)
    sys.modules.pop("factory_kit_absent_lib.io", None)
    sys.modules.pop("factory_kit_absent_lib.io.pyarrow", None)
