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
PARTS = ("trainer", "publish", "engine", "logprobs", "megatron_trainer", "grpo", "trainer_rl", "handoff", "grpo_step",
         "gap")


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_runs_every_part_and_prints_one_json_line(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(CHECK), "--smoke", "--profile", "--out", str(out)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
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
    e = r["engine"]
    assert e["engine_tokens_per_s"] > 0 and e["generate_tokens_per_s"] > 0 and e["all_full_length"] is True
    assert (tmp_path / "engine_profile.txt").is_file() and e["profile_decode_steps"] == 5
    p = r["publish"]
    assert p["bit_exact"] is True and p["dtype"] == "bf16" and 0 < p["delta_mb"] < p["full_mb"]
    assert r["logprobs"]["precision"] == "fp32" and r["logprobs"]["max_abs_diff"] < 1e-4  # fp32 on the CPU
    assert_issue_34_parts(r, tmp_path)
    assert_gap_part(r["gap"])


def assert_gap_part(g: dict) -> None:
    for variant in ("init", "peaked"):  # fp32 engine and trainer on the CPU: float noise
        v = g[variant]
        assert v["engine_dtype"] == "torch.float32" and v["tokens"] == 32 and v["trainer_fp32"]["gap_abs_mean"] < 1e-5
        assert g[f"{variant}_fp32_mean"] == v["trainer_fp32"]["gap_abs_mean"] and "trainer_bf16" not in v  # CUDA only
    assert g["peaked"]["sampled_logprob_mean"] > g["init"]["sampled_logprob_mean"]  # the scaled logits are peaked


def test_issue_35s_gap_part_runs_on_the_cpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    out = tmp_path / "c.json"
    assert load_check().main(["--smoke", "--parts", "gap", "--out", str(out)]) == 0
    assert_gap_part(json.loads(out.read_text())["gap"])


def assert_issue_34_parts(r: dict, where: Path) -> None:
    t = r["trainer_rl"]
    assert t["today_tokens_per_s"] > 0 and t["new_tokens_per_s"] > 0 and t["today_mfu"] is None  # MFU: GPU only
    assert not any(t["today_switches"].values()) and t["new_switches"]["packing"] and t["new_switches"]["fused_head"]
    assert all(real <= padded for real, padded in zip(t["real_tokens_per_step"], t["padded_tokens_per_step"],
                                                       strict=True))
    assert t["today_profile_top"] and t["new_profile_top"]
    text = (where / "trainer_profile.txt").read_text()
    assert "== today: one trainer step" in text and "== new: one trainer step" in text
    h = r["handoff"]
    assert h["in_process_bit_exact"] and h["codec_full_bit_exact"] and h["codec_delta_bit_exact"]
    assert 0 < h["codec_delta_mb"] < h["codec_full_mb"] and h["engine"] == "PagedEngine"
    assert "shared_s" in h or "shared_error" in h  # the shared buffer is another piece of issue 34
    g = r["grpo_step"]
    assert g["new_engine"].startswith("PagedEngine") and g["today_engine"].startswith("ContinuousEngine")
    for side in ("today", "new"):
        assert g[f"{side}_generated_tokens"] == 4 * 2 * 8 and not g[f"{side}_generate_extrapolated"]
        assert g[f"{side}_step_s"] == pytest.approx(sum(g[f"{side}_{p}_s"]
                                                        for p in ("generate", "score", "train", "handoff")), rel=1e-4)
    assert g["today_over_new"] > 0 and g["ratio_extrapolated"] is False


def test_issue_34s_parts_run_on_the_cpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    check = load_check()
    out = tmp_path / "c.json"
    assert check.main(["--smoke", "--parts", "trainer_rl,handoff,grpo_step", "--profile", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    for part in ("trainer_rl", "handoff", "grpo_step"):
        assert not {"error", "partial", "today_error", "new_error"} & set(r[part]), (part, r[part])
    assert_issue_34_parts(r, tmp_path)


def test_a_generation_past_its_budget_is_cancelled_and_extrapolated_from_the_tokens_made():
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import grpo_step_check
        from common import random_model
        from engine_check import word_tokenizer
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "gpu"))
    from factory.core.rollout.base import SamplingParams
    from factory.core.rollout.engines.continuous import ContinuousEngine

    model = random_model("micro")
    engine = ContinuousEngine(model, word_tokenizer(512), max_batch=8)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=0)
    got = grpo_step_check.generate_within(engine, [[1, 2, 3], [4, 5]], params, budget_s=0.0,
                                          dev=torch.device("cpu"))
    assert got["generate_extrapolated"] is True and "groups" not in got and got["generated_tokens"] > 0
    assert got["generate_s"] == pytest.approx(got["generate_measured_s"] * 4 * 6 / max(got["generated_tokens"], 1))
    assert engine.running == engine.queued == 0  # the cancelled samples left
    done = grpo_step_check.generate_within(engine, [[1, 2, 3]], params, budget_s=600.0, dev=torch.device("cpu"))
    assert not done["generate_extrapolated"] and [len(g) for g in done["groups"]] == [2]


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


def test_the_engine_part_runs_the_workload_to_full_length_and_profiles(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    check = load_check()
    out = tmp_path / "c.json"
    assert check.main(["--smoke", "--parts", "engine", "--profile", "--out", str(out)]) == 0
    e = json.loads(out.read_text())["engine"]
    assert not {"error", "partial"} & set(e), e
    assert e["seqs"] == 8 and e["generated_tokens"] == e["generated_target"] and e["all_full_length"] is True
    assert e["engine_stats"]["completed"] == 8 and e["engine_stats"]["prefill_tokens"] == e["prompt_tokens"]
    assert e["generate_seqs"] == 4 and e["engine_vs_generate"] > 0 and 0 < e["vs_roofline"]
    assert e["weights_dtype"] == "torch.float32" and e["served_from_copy"] is False  # bf16 only on CUDA
    text = (tmp_path / "engine_profile.txt").read_text()
    assert e["profile_decode_steps"] == 5 and "5 decode steps" in text and "aten::" in text


def test_nano_vllm_workload_and_the_decode_roofline():
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import engine_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks" / "gpu"))
    prompts, lengths = engine_check.workload(256, 100, 1024, 10000)
    assert (prompts, lengths) == engine_check.workload(256, 100, 1024, 10000)  # seeded
    assert len(prompts) == len(lengths) == 256
    assert all(100 <= len(p) <= 1024 and 0 <= min(p) and max(p) <= 10000 for p in prompts)
    assert all(100 <= m <= 1024 for m in lengths)
    # two sequences: 1 decode step with both live (lengths 3+1, 5+1), then 1 with the second (5+2): 4 + 6 + 7 keys
    roof = engine_check.decode_roofline([3, 5], [2, 3], weight_bytes=100, kv_per_token=10, bandwidth=1.0)
    assert roof["roofline_steps"] == 2 and roof["roofline_s"] == (100 + 10 * (4 + 6)) + (100 + 10 * 7)
    assert roof["roofline_tokens_per_s"] == 5 / roof["roofline_s"]
    with pytest.raises(ValueError, match=r"--engine-kw: PagedEngine takes no \['warp'\]"):
        engine_check.engine_keywords({"warp": 1}, torch.device("cpu"))
