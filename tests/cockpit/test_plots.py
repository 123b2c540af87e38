"""Plots: valid, deterministic, small PNGs of the expected size whatever the row order; lines that
stay distinguishable when they coincide; one line per benchmark or sweep member, never across runs;
clear errors when there is nothing to draw; log scale for axes that span decades or are swept
geometrically."""

from __future__ import annotations

import base64
import io
import random
import warnings
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from PIL import Image

from factory.cockpit.plots import (
    DPI,
    HEIGHT_IN,
    LEGEND_MAX_HEIGHT,
    PNG_SIGNATURE,
    SWEEP_HEIGHT_IN,
    SWEEP_WIDTH_IN,
    WIDTH_IN,
    _evals_over_steps_figure,
    _png,
    _run_curves_figure,
    _sweep_curves_figure,
    _sweep_summary_figure,
    axis_scale,
    evals_over_steps_png,
    markdown_image,
    run_curves_png,
    sweep_curves_png,
    sweep_summary_png,
)

SIZE = (round(WIDTH_IN * DPI), round(HEIGHT_IN * DPI))
SWEEP_SIZE = (round(SWEEP_WIDTH_IN * DPI), round(SWEEP_HEIGHT_IN * DPI))


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


def _shuffled(rows: list[dict], seed: int = 0) -> list[dict]:
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows


def _check_png(png: bytes, size: tuple[int, int] = SIZE, max_bytes: int = 80_000) -> None:
    assert png.startswith(PNG_SIGNATURE)
    assert len(png) < max_bytes
    with Image.open(io.BytesIO(png)) as im:
        assert im.format == "PNG" and im.size == size
        assert "Software" not in im.info


def _lines(ax) -> dict[str, object]:
    return {line.get_label(): line for line in ax.get_lines()}


def _legend_fits(fig) -> bool:
    renderer = fig.canvas.get_renderer()
    boxes = [leg.get_window_extent(renderer) for leg in fig.legends]
    return all(b.width <= fig.bbox.width and b.height <= LEGEND_MAX_HEIGHT * fig.bbox.height for b in boxes)


def test_run_curves_is_a_deterministic_small_png():
    png = run_curves_png(_steps(), _evals(), title="quickstart seed 0")
    _check_png(png)
    assert run_curves_png(_steps(), _evals(), title="quickstart seed 0") == png
    # Row order does not matter (Iceberg scans come back in any order).
    assert run_curves_png(_steps()[::-1], _evals()[::-1], title="quickstart seed 0") == png
    assert run_curves_png(_shuffled(_steps()), _shuffled(_evals()), title="quickstart seed 0") == png


def _binary_steps(n: int = 40) -> list[dict]:
    # Binary rewards: the mean reward is the training-sample accuracy, step for step.
    return [{"run_id": "r1", "step": i, "reward_mean": (i % 7) / 7, "accuracy": (i % 7) / 7} for i in range(n)]


def test_run_curves_coinciding_reward_and_accuracy_are_two_distinct_lines():
    ax = _run_curves_figure(_binary_steps()).axes[0]
    lines = _lines(ax)
    assert set(lines) == {"reward mean (train)", "accuracy (train) = reward"}
    reward, acc = lines["reward mean (train)"], lines["accuracy (train) = reward"]
    assert list(reward.get_ydata()) == list(acc.get_ydata())  # they do coincide...
    assert to_rgba(reward.get_color()) != to_rgba(acc.get_color())  # ...and are still told apart
    assert reward.get_linestyle() != acc.get_linestyle()
    assert (reward.get_marker(), acc.get_marker()) != ("None", "None")
    assert acc.get_zorder() > reward.get_zorder()  # the dashed one on top, so both colors show


def test_run_curves_coinciding_lines_both_show_in_the_pixels():
    fig = _run_curves_figure(_binary_steps())
    png = _png(fig)  # draws the figure: the axes box is final now
    box = fig.axes[0].get_window_extent()
    with Image.open(io.BytesIO(png)) as im:
        rgb = im.convert("RGB")
        h = rgb.size[1]
        # Inside the axes only: the legend, below them, shows both colors whatever the curves do.
        inside = rgb.crop((int(box.x0) + 2, h - int(box.y1) + 2, int(box.x1) - 2, h - int(box.y0) - 2))
        pixels = np.asarray(inside, dtype=int)
    for name in ("C0", "C1"):
        color = np.array([round(255 * c) for c in to_rgba(name)[:3]])
        near = int((np.abs(pixels - color).sum(axis=-1) < 40).sum())
        assert near > 50, f"{name} barely visible ({near} pixels)"


def test_run_curves_labels_differing_reward_and_accuracy_plainly():
    lines = _lines(_run_curves_figure(_steps()).axes[0])
    assert set(lines) == {"reward mean (train)", "accuracy (train)"}
    # Reward present at fewer steps than accuracy: not equal at every step either.
    steps = _binary_steps()
    steps[3]["reward_mean"] = None
    assert "accuracy (train)" in _lines(_run_curves_figure(steps).axes[0])


def test_run_curves_joins_evals_only_within_a_benchmark_in_step_order():
    evals = _evals() + [{"run_id": "r1", "step": s, "benchmark": "carry_chains", "metric": "accuracy", "value": 0.3}
                        for s in (30, 10)]
    ax = _run_curves_figure([], _shuffled(evals, 3)).axes[0]
    lines = _lines(ax)
    assert set(lines) == {"held-out heldout", "held-out carry_chains"}  # no slice, no pass@8
    heldout = lines["held-out heldout"]
    assert list(heldout.get_xdata()) == [0, 20, 40] and list(heldout.get_ydata()) == [0.0, 0.4, 0.8]
    assert list(lines["held-out carry_chains"].get_xdata()) == [10, 30]
    for line in lines.values():
        assert line.get_linestyle() == "-" and line.get_marker() not in ("None", "", None)
    assert to_rgba(heldout.get_color()) != to_rgba(lines["held-out carry_chains"].get_color())


def test_run_curves_refuses_rows_of_two_runs():
    with pytest.raises(ValueError, match="r1, r2"):
        run_curves_png(_steps(), [dict(r, run_id="r2") for r in _evals()])


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


# -- evals over steps ----------------------------------------------------------------------------


def _run_evals(run_id: str = "r1") -> list[dict]:
    rows = []
    for step in (0, 10, 20, 30):
        for bench, base in (("arithmetic_heldout", 0.2), ("carry_chains", 0.1)):
            rows.append({"run_id": run_id, "step": step, "benchmark": bench, "metric": "accuracy",
                         "value": base + step / 100, "n": 200})
            rows.append({"run_id": run_id, "step": step, "benchmark": bench, "metric": "pass@8", "value": 0.95,
                         "n": 200})
            rows.append({"run_id": run_id, "step": step, "benchmark": f"{bench}/3", "metric": "accuracy",
                         "value": 0.01, "n": 50})
    return rows


def test_evals_over_steps_is_a_deterministic_small_png():
    png = evals_over_steps_png(_run_evals(), title="r1")
    _check_png(png)
    assert evals_over_steps_png(_run_evals(), title="r1") == png
    assert evals_over_steps_png(_shuffled(_run_evals(), 1), title="r1") == png
    assert evals_over_steps_png(_shuffled(_run_evals(), 2), title="r1") == png


def test_evals_over_steps_one_line_per_whole_benchmark_of_the_metric():
    ax = _evals_over_steps_figure(_shuffled(_run_evals())).axes[0]
    lines = _lines(ax)
    assert set(lines) == {"arithmetic_heldout", "carry_chains"}  # slices left out
    for bench, base in (("arithmetic_heldout", 0.2), ("carry_chains", 0.1)):
        line = lines[bench]
        assert list(line.get_xdata()) == [0, 10, 20, 30]
        assert list(line.get_ydata()) == pytest.approx([base, base + 0.1, base + 0.2, base + 0.3])  # not pass@8
        assert line.get_marker() not in ("None", "", None) and line.get_linestyle() == "-"
    assert ax.get_ylim() == pytest.approx((-0.03, 1.03))
    assert "r1" in ax.get_title()


def test_evals_over_steps_other_metric_and_chosen_benchmarks():
    lines = _lines(_evals_over_steps_figure(_run_evals(), metric="pass@8").axes[0])
    assert set(lines) == {"arithmetic_heldout", "carry_chains"}
    assert all(list(line.get_ydata()) == [0.95] * 4 for line in lines.values())
    lines = _lines(_evals_over_steps_figure(_run_evals(), benchmarks=["carry_chains"]).axes[0])
    assert set(lines) == {"carry_chains"}
    # A slice named explicitly is drawn.
    lines = _lines(_evals_over_steps_figure(_run_evals(), benchmarks=["carry_chains/3"]).axes[0])
    assert set(lines) == {"carry_chains/3"}


def test_evals_over_steps_frame_is_not_forced_for_values_outside_0_1():
    rows = [{"run_id": "r1", "step": s, "benchmark": "b", "metric": "mean_length", "value": 40.0 + s}
            for s in range(3)]
    ax = _evals_over_steps_figure(rows, metric="mean_length").axes[0]
    assert ax.get_ylim()[1] > 40


def test_evals_over_steps_refuses_two_runs():
    with pytest.raises(ValueError, match="r1, r2"):
        evals_over_steps_png(_run_evals("r1") + _run_evals("r2"))
    # Even when the other run's rows would not be drawn (another metric): they are still another run.
    other = [dict(r, run_id="r2") for r in _run_evals() if r["metric"] == "pass@8"]
    with pytest.raises(ValueError, match="2 runs"):
        evals_over_steps_png(_run_evals("r1") + other)


def test_evals_over_steps_nothing_to_draw():
    with pytest.raises(ValueError, match="nothing to plot.*'accuracy'"):
        evals_over_steps_png([r for r in _run_evals() if "/" in r["benchmark"] or r["metric"] != "accuracy"])
    with pytest.raises(ValueError, match="nothing to plot.*'f1'"):
        evals_over_steps_png(_run_evals(), metric="f1")
    with pytest.raises(ValueError, match="nothing_here"):
        evals_over_steps_png(_run_evals(), benchmarks=["nothing_here"])
    with pytest.raises(ValueError, match="nothing to plot"):
        evals_over_steps_png([])


def test_evals_over_steps_duplicate_points_take_the_latest_row():
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    base = {"run_id": "r1", "step": 10, "benchmark": "b", "metric": "accuracy"}
    rows = [dict(base, value=0.9, recorded_at=t0), dict(base, value=0.2, recorded_at=t0 + timedelta(hours=1)),
            dict(base, step=0, value=0.1, recorded_at=t0)]
    for order in (rows, rows[::-1]):
        line = _lines(_evals_over_steps_figure(order).axes[0])["b"]
        assert list(line.get_xdata()) == [0, 10] and list(line.get_ydata()) == [0.1, 0.2]
    # Without recorded_at the rule still does not depend on the order.
    bare = [{k: v for k, v in r.items() if k != "recorded_at"} for r in rows]
    assert evals_over_steps_png(bare) == evals_over_steps_png(bare[::-1])


# -- sweep curves ---------------------------------------------------------------------------------


def _sweep_members(k: int = 3, steps: int = 30) -> list[dict]:
    members = []
    for m in range(k):
        run = f"run{m}"
        members.append({
            "label": f"algorithm.lr={10 ** -(m % 4 + 3):g}, seed={m // 4}",
            "steps": [{"run_id": run, "step": i, "reward_mean": min(1.0, (m + 1) * i / (4 * steps)),
                       "accuracy": 0.5} for i in range(steps)],
            "evals": [{"run_id": run, "step": s, "benchmark": b, "metric": met, "value": v}
                      for s in range(0, steps + 1, 10)
                      for b, met, v in (("arithmetic_heldout", "accuracy", (m + 1) * s / 200),
                                        ("arithmetic_heldout", "pass@8", 0.99),
                                        ("arithmetic_heldout/3", "accuracy", 0.01))],
        })
    return members


def test_sweep_curves_is_a_deterministic_png_of_the_sweep_size():
    png = sweep_curves_png(_sweep_members(), title="lr sweep")
    _check_png(png, SWEEP_SIZE, max_bytes=150_000)
    assert sweep_curves_png(_sweep_members(), title="lr sweep") == png
    shuffled = [dict(m, steps=_shuffled(m["steps"], i), evals=_shuffled(m["evals"], i + 7))
                for i, m in enumerate(_sweep_members())]
    assert sweep_curves_png(shuffled, title="lr sweep") == png


def test_sweep_curves_one_line_per_member_in_each_panel_with_matching_colors():
    members = _sweep_members()
    fig = _sweep_curves_figure(members)
    train, held = fig.axes
    labels = [m["label"] for m in members]
    assert [line.get_label() for line in train.get_lines()] == labels
    assert [line.get_label() for line in held.get_lines()] == labels
    for a, b in zip(train.get_lines(), held.get_lines(), strict=True):
        assert to_rgba(a.get_color()) == to_rgba(b.get_color()) and a.get_linestyle() == b.get_linestyle()
    assert len({to_rgba(line.get_color()) for line in train.get_lines()}) == 3
    # The held-out panel is accuracy on the whole benchmark: no pass@8, no slice.
    assert list(held.get_lines()[2].get_ydata()) == pytest.approx([0.0, 0.15, 0.3, 0.45])
    assert "arithmetic_heldout" in held.get_title()
    assert [t.get_text() for t in fig.legends[0].get_texts()] == labels


def test_sweep_curves_skips_members_without_rows_per_panel():
    members = _sweep_members()
    members[0]["evals"] = []
    members[1]["steps"] = [dict(r, reward_mean=None) for r in members[1]["steps"]]
    members.append({"label": "failed", "steps": [], "evals": []})
    fig = _sweep_curves_figure(members)
    train, held = fig.axes
    assert [line.get_label() for line in train.get_lines()] == [members[0]["label"], members[2]["label"]]
    assert [line.get_label() for line in held.get_lines()] == [members[1]["label"], members[2]["label"]]
    # A member keeps its color in both panels although the panels draw different members.
    assert to_rgba(train.get_lines()[1].get_color()) == to_rgba(held.get_lines()[1].get_color())
    assert "failed" not in [t.get_text() for t in fig.legends[0].get_texts()]
    _check_png(sweep_curves_png(members), SWEEP_SIZE, max_bytes=150_000)


@pytest.mark.slow
def test_sweep_curves_many_members_get_distinct_styles_and_a_legend_that_fits():
    members = _sweep_members(32, steps=20)
    for m in members:  # labels as long as a real sweep's: four columns of them would not fit
        m["label"] += ", algorithm.group_size=8, sampling.temperature=1.0"
    fig = _sweep_curves_figure(members)
    styles = {(to_rgba(line.get_color()), line.get_linestyle()) for line in fig.axes[0].get_lines()}
    assert len(styles) == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # constrained layout warns when the legend squeezes the axes away
        _png(fig)
    assert _legend_fits(fig)
    assert len(fig.legends) == 1 and len(fig.legends[0].get_texts()) == 32
    assert all(ax.get_window_extent().height > 0.3 * fig.bbox.height for ax in fig.axes)  # curves keep room
    _check_png(sweep_curves_png(members), SWEEP_SIZE, max_bytes=400_000)


def test_sweep_curves_benchmark_choice():
    def evals(run, benches):
        return [{"run_id": run, "step": 0, "benchmark": b, "metric": "accuracy", "value": 0.5} for b in benches]

    members = [{"label": "a", "steps": [], "evals": evals("a", ["zeta", "carry_chains"])},
               {"label": "b", "steps": [], "evals": evals("b", ["zeta", "carry_chains"])},
               {"label": "c", "steps": [], "evals": evals("c", ["zeta", "long/3", "long/4"])}]
    assert "zeta" in _sweep_curves_figure(members).axes[1].get_title()  # in the most members
    members[2]["evals"] = evals("c", ["carry_chains"])
    assert "carry_chains" in _sweep_curves_figure(members).axes[1].get_title()  # tie: alphabetical
    fig = _sweep_curves_figure(members, benchmark="zeta")
    assert "zeta" in fig.axes[1].get_title() and len(fig.axes[1].get_lines()) == 2


def test_sweep_curves_errors():
    with pytest.raises(ValueError, match="nothing to plot"):
        sweep_curves_png([])
    with pytest.raises(ValueError, match="nothing to plot"):
        sweep_curves_png([{"label": "x", "steps": [{"run_id": "x", "step": 0, "loss": 1.0}], "evals": []}])
    with pytest.raises(ValueError, match="'nope'"):
        sweep_curves_png([dict(m, steps=[]) for m in _sweep_members()], benchmark="nope")
    mixed = _sweep_members(2)
    mixed[0]["evals"] = mixed[1]["evals"]  # member 0's evals are another run's
    with pytest.raises(ValueError, match="run0, run1"):
        sweep_curves_png(mixed)


# -- sweep summary --------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    ("name", "values", "scale"),
    [
        ("algorithm.lr", [1e-4, 3e-4], "log"),
        ("algorithm.learning_rate", [1e-4, 3e-4], "log"),
        ("sft.warmup_lr", [1e-5, 2e-5], "log"),
        ("algorithm.kl_coef", [0.01, 0.04], "log"),
        ("algorithm.beta", [0.01, 0.04], "log"),
        ("optimizer.weight_decay", [0.01, 0.1], "log"),
        ("algorithm.lr", [1e-4, 1e-4], "linear"),  # one distinct value: nothing swept
        ("algorithm.lr", [3e-4], "linear"),
        ("algorithm.kl_coef", [0.0, 0.04], "linear"),  # a zero cannot go on a log axis
        ("algorithm.group_size", [4, 8], "linear"),
        ("algorithm.lr_schedule", [1, 2], "linear"),  # "lr" must be the whole last part or its suffix
        ("algorithm.name", ["grpo", "dapo"], "category"),
        ("algorithm.lr", ["1e-4", "3e-4"], "category"),
        ("algorithm.beta", [True, False], "category"),
        (None, [1e-4, 3e-4], "linear"),
    ],
)
def test_axis_scale_by_name(name, values, scale):
    assert axis_scale(values, name) == scale


def test_sweep_summary_draws_a_learning_rate_axis_on_log_scale():
    members = [{"algorithm.lr": lr, "algorithm.group_size": g, "seed": s, "final_accuracy": 0.5 + s / 10}
               for lr in (1e-4, 3e-4) for g in (4, 8) for s in range(2)]
    assert _sweep_summary_figure(members, "algorithm.lr").axes[0].get_xscale() == "log"
    assert _sweep_summary_figure(members, "algorithm.group_size").axes[0].get_xscale() == "linear"
    _check_png(sweep_summary_png(members, "algorithm.lr", group_by=["algorithm.group_size"]))


def test_markdown_image_embeds_the_png():
    png = run_curves_png(_steps(10))
    md = markdown_image(png, "curves [run r1]\nseed 0")
    assert md.startswith("![curves (run r1) seed 0](data:image/png;base64,") and md.endswith(")")
    assert base64.b64decode(md.split("base64,", 1)[1][:-1]) == png
    with pytest.raises(ValueError, match="not a PNG"):
        markdown_image(b"GIF89a", "x")
