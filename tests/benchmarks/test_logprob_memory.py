"""benchmarks/logprob_memory.py --smoke: every variant runs in its own process on the micro shape and measures a
peak; the old and the new log-probs (and activation checkpointing) give the same loss, gradient norm and entropy;
the fused head's variant (asked for by name) too, measured in this process."""

from __future__ import annotations

import importlib
import json

import pytest

bench = importlib.import_module("benchmarks.logprob_memory")


def test_smoke_measures_every_variant_with_the_same_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    result = bench.main(["--smoke"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == result  # the last line is the JSON result
    variants = result["variants"]
    assert set(variants) == {"old", "new", "new+ac"}
    old = variants["old"]
    for v in variants.values():
        assert v["peak_mib"] > 0
        for key in ("loss", "grad_norm", "entropy"):
            assert v[key] == pytest.approx(old[key], rel=1e-5, abs=1e-6), key


def test_unknown_variant_is_named() -> None:
    with pytest.raises(SystemExit, match="--variants: expected some of old, new, new\\+ac, fused, got \\['fast'\\]"):
        bench.main(["--smoke", "--variants", "old,fast"])


def test_the_fused_variant_gives_the_numbers_of_the_chunked_one() -> None:
    new, fused = (bench.measure(v, "micro", None, 2, 64, "float32", "cpu", 512 * 16) for v in ("new", "fused"))
    for key in ("loss", "grad_norm", "entropy"):
        assert fused[key] == pytest.approx(new[key], rel=1e-6, abs=1e-6), key
