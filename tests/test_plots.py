"""Plots: valid, deterministic, small PNGs of the expected size; clear errors when there is nothing to
draw; log scale for axes that span decades."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from factory.plots import (
    DPI,
    HEIGHT_IN,
    PNG_SIGNATURE,
    WIDTH_IN,
    axis_scale,
    markdown_image,
    run_curves_png,
    sweep_summary_png,
)

SIZE = (round(WIDTH_IN * DPI), round(HEIGHT_IN * DPI))


def _steps(n: int = 60) -> list[dict]:
    return [{"run_id": "r1", "step": i, "reward_mean": i / n, "accuracy": min(1.0, 1.5 * i / n),
             "loss": 1.0 - i / n} for i in range(n)]


def _evals() -> list[dict]:
    rows = []
    for step in (0, 20, 40):
        rows.append({"run_id": "r1", "step": step, "benchmark": "heldout", "metric": "accuracy", "value": step / 50})
        rows.append({"run_id": "r1", "step": step, "benchmark": "heldout", "metric": "pass@8", "value": 0.9})
        rows.append({"run_id": "r1", "step": step, "benchmark": "heldout/add3", "metric": "accuracy", "value": 0.1})
    return rows


def _members() -> list[dict]:
    return [{"algorithm.lr": lr, "seed": seed, "final_accuracy": 0.4 + 0.1 * k + 0.01 * seed}
            for k, lr in enumerate((1e-5, 1e-4, 1e-3)) for seed in (0, 1)]


def _check_png(png: bytes) -> None:
    assert png.startswith(PNG_SIGNATURE)
    assert len(png) < 80_000
    with Image.open(io.BytesIO(png)) as im:
        assert im.format == "PNG" and im.size == SIZE
        assert "Software" not in im.info


def test_run_curves_is_a_deterministic_small_png():
    png = run_curves_png(_steps(), _evals(), title="quickstart seed 0")
    _check_png(png)
    assert run_curves_png(_steps(), _evals(), title="quickstart seed 0") == png
    # Row order does not matter (Iceberg scans come back in any order).
    assert run_curves_png(_steps()[::-1], _evals()[::-1], title="quickstart seed 0") == png


def test_run_curves_draws_with_only_one_source():
    _check_png(run_curves_png(_steps()))
    _check_png(run_curves_png([], _evals()))
    _check_png(run_curves_png([{"step": 0, "reward_mean": 0.2, "accuracy": None}]))


def test_run_curves_without_anything_to_draw_is_an_error():
    with pytest.raises(ValueError, match="nothing to plot"):
        run_curves_png([])
    with pytest.raises(ValueError, match="nothing to plot"):
        # Only rows that are not drawn: another metric, a per-slice benchmark, a step with no reward.
        run_curves_png([{"step": 0, "loss": 1.0}], [r for r in _evals() if r["metric"] != "accuracy"
                                                    or "/" in r["benchmark"]])


def test_sweep_summary_is_a_deterministic_small_png():
    for group_by in (None, ["seed"]):
        png = sweep_summary_png(_members(), "algorithm.lr", group_by=group_by)
        _check_png(png)
        assert sweep_summary_png(_members(), "algorithm.lr", group_by=group_by) == png


def test_sweep_summary_categorical_axis_and_skipped_members():
    members = [{"algorithm.name": name, "seed": s, "final_accuracy": 0.5 + s / 10}
               for name in ("grpo", "dapo", "cispo") for s in range(2)]
    members.append({"algorithm.name": "gspo", "seed": 0, "final_accuracy": None})  # failed member
    _check_png(sweep_summary_png(members, "algorithm.name"))


def test_sweep_summary_errors():
    members = [{"algorithm.lr": 1e-4, "final_accuracy": None}]
    with pytest.raises(ValueError, match="'final_accuracy'"):
        sweep_summary_png(members, "algorithm.lr")
    with pytest.raises(ValueError, match="'reward'"):
        sweep_summary_png(_members(), "algorithm.lr", metric="reward")
    with pytest.raises(ValueError, match="group_by"):
        sweep_summary_png(_members(), "seed", group_by=["seed"])


@pytest.mark.parametrize(
    ("values", "scale"),
    [
        ([1e-5, 1e-4, 1e-3], "log"),
        ([1e-5, 1e-3], "log"),  # exactly two decades
        ([1e-5, 5e-5, 9e-5], "linear"),
        ([0, 1, 2, 3], "linear"),
        ([0.0, 1e-5, 1e-2], "linear"),  # a zero cannot go on a log axis
        ([-1.0, 10.0, 1000.0], "linear"),
        ([8], "linear"),
        (["grpo", "dapo"], "category"),
        ([True, False], "category"),
        ([1e-4, None], "category"),
        ([], "category"),
    ],
)
def test_axis_scale(values, scale):
    assert axis_scale(values) == scale


def test_markdown_image_embeds_the_png():
    png = run_curves_png(_steps(10))
    md = markdown_image(png, "curves [run r1]\nseed 0")
    assert md.startswith("![curves (run r1) seed 0](data:image/png;base64,") and md.endswith(")")
    assert base64.b64decode(md.split("base64,", 1)[1][:-1]) == png
    with pytest.raises(ValueError, match="not a PNG"):
        markdown_image(b"GIF89a", "x")
