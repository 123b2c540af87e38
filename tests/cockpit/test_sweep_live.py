"""A running sweep read from a real lake (factory/cockpit/sweep_live.py): members by their axis values,
newest step, ETA, interruptions, what changes the fingerprint, one read per table; and every picture a sweep's page
shows fits the
page (widths read from the PNG bytes)."""

import json
import struct
from datetime import UTC, datetime, timedelta

import pytest

from factory.cockpit import plots
from factory.cockpit.reports import compare_sweep, small
from factory.cockpit.sweep_live import live_sweeps, sweep_rows, unfinished
from factory.lake.writer import Lake

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PAGE_PX = 1000  # the widest a picture may be: shown alone (an event's page, [Show Markdown])
# The widest an inline picture may be: the value column of the Dagster UI's metadata table on a sweep summary's
# overview is about 500 px wide in a 1600 px window (measured in chromium, Dagster 1.13) and narrower with longer
# keys; 600 px pictures were cut there, and 480 px ones with a long axis name (issue 32).
INLINE_PX = 448


def width(png: bytes) -> int:
    assert png.startswith(plots.PNG_SIGNATURE)
    return struct.unpack(">I", png[16:20])[0]  # IHDR: width, then height


def sweep_row(sweep_id: str, member: str, lr: float, status: str, run_id: str | None = None, **more) -> dict:
    return dict(sweep_id=sweep_id, member=f"{sweep_id}-{member}", name="s", axes=json.dumps({"algorithm.lr": lr}),
                spec=json.dumps({"schedule": {"steps": 20}}), status=status, run_id=run_id, created_at=T0,
                recorded_at=T0, **more)


def steps(run_id: str, numbers, attempt: int = 1, reward: float = 0.0) -> list[dict]:
    return [dict(run_id=run_id, step=s, weight_version=s, reward_mean=reward + 0.02 * s, attempt=attempt,
                 recorded_at=T0 + timedelta(seconds=5 * s)) for s in numbers]


@pytest.fixture
def running(lake):
    lake.upsert("sweeps", [sweep_row("s", "m000", 1e-3, "running", "r0"), sweep_row("s", "m001", 3e-4, "running", "r1"),
                           sweep_row("s", "m002", 1e-2, "queued"),
                           sweep_row("old", "m000", 1e-3, "succeeded", "r9", final_accuracy=0.5)])
    lake.upsert("steps", steps("r0", range(1, 9)) + steps("r1", range(1, 4)) + steps("r1", range(3, 7), attempt=2))
    lake.upsert("evals", [dict(run_id="r0", step=4, benchmark="arithmetic_heldout", metric="accuracy", value=0.3, n=200,
                               recorded_at=T0)])
    lake.upsert("interruptions", [dict(run_id="r1", attempt=1, cause="killed", last_step=3, resumed_from_step=2,
                                       recorded_at=T0)])
    return lake


def test_a_running_sweep_has_each_member_by_its_axis_values_step_eta_and_interruptions(running):
    rows = sweep_rows(running)
    assert unfinished(rows) == ["s"]  # `old` has ended
    (live,) = live_sweeps(running, {"s": rows["s"]}).values()
    a, b, c = live.members
    assert [m.label for m in live.members] == ["lr=1e-3", "lr=3e-4", "lr=0.01"]
    # a: 5 s a step, 12 steps left; its eval at step 4 is its result so far
    assert (a.step, a.steps, a.eta_s, a.evals) == (8, 20, 60.0, 1)
    assert a.outcome.primary.text() == "0.300 [0.241, 0.367] n=200"
    # b was resumed: the ETA is its second attempt's pace (5 s a step from step 3 to 6), 14 steps left
    assert (b.step, b.eta_s, [r["resumed_from_step"] for r in b.interruptions]) == (6, 70.0, [2])
    assert (c.status, c.run_id, c.step, c.eta_s) == ("queued", None, None, None)
    assert [m["label"] for m in live.overlay] == ["lr=1e-3", "lr=3e-4"]  # the legend: members with a run
    assert not live.ended

    before = live.fingerprint()
    running.upsert("steps", steps("r1", [7], attempt=2))
    after = live_sweeps(running, {"s": sweep_rows(running)["s"]})["s"].fingerprint()
    assert after != before and [k for k in after if after[k] != before[k]] == ["s-m001"]


def test_the_lake_is_read_once_per_table(running, monkeypatch):
    reads: list[str] = []
    real = Lake.read

    def counted(self, table, row_filter=None):
        reads.append(table)
        return real(self, table, row_filter)

    monkeypatch.setattr(Lake, "read", counted)
    rows = sweep_rows(running)
    live_sweeps(running, rows)
    assert sorted(reads) == ["evals", "interruptions", "steps", "sweeps"]


def test_every_picture_of_a_sweeps_page_fits_the_page(running):
    # 30 members: the legend is the widest part of an overlay
    running.upsert("sweeps", [sweep_row("wide", f"m{i:03d}", 1e-4 * (i + 1), "running", f"w{i}") for i in range(30)])
    running.upsert("steps", [r for i in range(30) for r in steps(f"w{i}", range(1, 6), reward=0.01 * i)])
    live = live_sweeps(running, {"s": sweep_rows(running)["s"], "wide": sweep_rows(running)["wide"]})
    pictures = {f"live {s}": live[s].picture for s in live}
    pictures.update({f"summary {name}": render for name, render in compare_sweep(running, "s").pictures.items()})
    pictures["summary accuracy_vs_lr"] = lambda dpi: plots.sweep_summary_png(
        [{"algorithm.lr": 1e-3, "final_accuracy": 0.3}, {"algorithm.lr": 3e-4, "final_accuracy": 0.4}],
        "algorithm.lr", dpi=dpi)
    pictures["run curves"] = lambda dpi: plots.run_curves_png(steps("r0", range(1, 9)), title="r0", dpi=dpi)
    assert len(pictures) == 5
    for name, render in pictures.items():
        full, inline = width(render(plots.DPI)), width(render(plots.INLINE_DPI))
        assert full <= PAGE_PX and inline <= INLINE_PX, (name, full, inline)  # the inline copy (`small`) beside a key
    assert small("plots/live_curves.png") == "plots/live_curves.small.png"


def test_the_members_sampler_trainer_gap_is_drawn_beside_their_curves(running):
    """r0 measured the gap on steps 1-8 (rows as StepLog writes a StepRecord with the gap fields), r1 measured none:
    the live picture gains a row with the gap's mean |Δ log-prob| and KL by step, r0's line there with r0's figures
    and r1's absent, and it still fits the page; a sweep with no gap measured keeps its one-row picture."""
    from factory.runs.step_rows import StepLog
    from tests.gap_records import gap_record

    before = live_sweeps(running, {"s": sweep_rows(running)["s"]})["s"].picture(plots.DPI)
    log = StepLog("r0", attempt=1)
    for s in range(1, 9):
        r = gap_record(1)
        r.step, r.weight_version, r.reward_mean = s, s, 0.02 * s
        r.gap_abs_mean, r.gap_kl = 0.01 * s, 1e-4 * s * s
        log.add(r)
    log.flush(running)
    live = live_sweeps(running, {"s": sweep_rows(running)["s"]})["s"]
    (r0,) = [m for m in live.overlay if m["label"] == "lr=1e-3"]
    assert [(r["step"], r["gap_abs_mean"], r["gap_kl"]) for r in sorted(r0["steps"], key=lambda r: r["step"])] == [
        (s, 0.01 * s, 1e-4 * s * s) for s in range(1, 9)]
    fig = plots._sweep_curves_figure(live.overlay, "s")
    panels = {ax.get_title(): ax for ax in fig.axes}
    gap, kl = panels["sampler/trainer gap: mean |Δ log-prob|"], panels["sampler/trainer KL (k3)"]
    assert [ln.get_label() for ln in gap.get_lines()] == [ln.get_label() for ln in kl.get_lines()] == ["lr=1e-3"]
    assert list(kl.get_lines()[0].get_ydata()) == [1e-4 * s * s for s in range(1, 9)]
    assert list(gap.get_lines()[0].get_xdata()) == list(range(1, 9))
    # the member keeps its color in every panel
    assert gap.get_lines()[0].get_color() == panels["train reward (mean)"].get_lines()[0].get_color()
    after = live.picture(plots.DPI)
    assert (width(before), height(before)) == (640, 420) and (width(after), height(after)) == (640, 720)
    assert width(live.picture(plots.INLINE_DPI)) <= INLINE_PX


def height(png: bytes) -> int:
    return struct.unpack(">I", png[20:24])[0]
