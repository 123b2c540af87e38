"""benchmarks/mismatch.py without its runs: every arm is a valid spec that says what the arm claims, and the
summary's intervals and differences hold together."""

from __future__ import annotations

import importlib

import pytest

from factory.config import apply_overrides, load_spec

mm = importlib.import_module("benchmarks.mismatch")


@pytest.mark.parametrize("arm", list(mm.ARMS))
def test_each_arm_is_a_valid_quickstart_spec_that_means_what_its_name_says(arm):
    s = apply_overrides(load_spec(mm.QUICKSTART), mm.ARMS[arm])
    a, c = s.algorithm, s.algorithm.correction
    assert a.resolved_dual_clip(off_policy=True) is None  # the dual clip never hides a correction's effect
    assert s.rollout.round_weights == (None if arm == "clean" else "bf16")
    recompute = a.recomputes(engine_differs=s.rollout.round_weights is not None)
    assert recompute == (arm not in ("clean", "mismatched"))
    corrections = {"tis_token": "token", "tis_seq": "sequence"}
    assert c.tis_mode(recompute) == corrections.get(arm, "off")
    assert (c.mis is not None) == (arm == "mis") and (c.icepop is not None) == (arm == "icepop")


def _row(arm: str, seed: int, acc: float, gap: float | None) -> dict:
    return {"arm": arm, "seed": seed, "accuracy": acc, "n": 200, "wall_s": 1.0,
            **{f"{k}_mean": None for k in mm.GAP_KEYS}, "gap_abs_mean_mean": gap}


def test_the_summary_pools_seeds_and_compares_with_clean():
    rows = [_row("clean", s, a, 1e-7) for s, a in enumerate((0.70, 0.72, 0.74))]
    rows += [_row("mismatched", s, a, 2e-3) for s, a in enumerate((0.50, 0.55, 0.60))]
    out = mm.summarize(rows, ["clean", "mismatched"])
    clean, bad = out["clean"], out["mismatched"]
    assert clean["pooled_n"] == 600 and clean["accuracy_mean"] == pytest.approx(0.72)
    assert clean["pooled_ci95"][0] < 0.72 < clean["pooled_ci95"][1]
    assert clean["seed_mean_ci95"][0] < 0.72 < clean["seed_mean_ci95"][1]
    assert clean["diff_vs_clean"] is None
    assert bad["diff_vs_clean"] == pytest.approx(-0.17)
    lo, hi = bad["diff_vs_clean_ci95"]
    assert lo < -0.17 < hi < 0  # 0.72 vs 0.55 on 600 problems each: a real difference
    wlo, whi = bad["diff_vs_clean_welch_ci95"]
    assert wlo < lo and hi < whi < 0  # over 3 seeds: wider, the seeds' spread counted, still below 0
    assert bad["gap_abs_mean_mean"] == pytest.approx(2e-3)
