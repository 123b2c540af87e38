"""benchmarks/fused_head.py --smoke: the memory mode's accounting on fake tensors (matmul FLOPs exactly 3 or 4 head
matmuls; what each variant holds for backward) and the time mode's values against the chunked head."""

from __future__ import annotations

import importlib
import json

import pytest

bench = importlib.import_module("benchmarks.fused_head")


def test_memory_mode_counts_what_each_variant_keeps(capsys: pytest.CaptureFixture[str]) -> None:
    result = bench.main(["--smoke"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    n, h, v = result["tokens"], result["hidden"], result["vocab"]
    matmul = 2 * n * h * v  # one head matmul over the target rows, FLOPs
    for precision in ("float32", "bf16_autocast"):
        r = result[precision]
        # full: forward and the two gradients over all N + 1 rows; chunked (checkpointed) and fused: + a recompute
        assert r["full"]["matmul_flops"] == 3 * matmul // n * (n + 1)
        assert r["chunked"]["matmul_flops"] == r["fused"]["matmul_flops"] == 4 * matmul
        assert r["fused+keep"]["matmul_flops"] == 3 * matmul
        logits = n * v * (4 if precision == "float32" else 2)  # [N, V] in the compute dtype
        assert r["full"]["held_bytes"] >= 2 * n * v * 4  # float32 log-softmax and more
        assert logits <= r["fused+keep"]["held_bytes"] < logits + n * v
        assert r["fused"]["held_bytes"] < n * v  # the logsumexp and outputs, [N] each


def test_time_mode_agrees_with_the_chunked_head() -> None:
    result = bench.main(["--smoke", "--mode", "time", "--device", "cpu"])
    assert set(result["variants"]) == set(bench.VARIANTS)
    for r in result["variants"].values():
        assert r["n"] == 2 and r["median_s"] >= 0
        assert r["max_abs_diff_vs_chunked"] < 1e-5
