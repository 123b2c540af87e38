"""factory/cockpit/metric_panel.py: a run's metric panel from the lake's `steps` rows, written as the trainer
writes them (`core.loop._record` of real scored groups, `runs.step_rows.StepLog` into a real Iceberg lake): every
cell is drawn,
with the run's values, and a metric the run did not record says so; and `reports.run_pictures` stores it on the
run's real MLflow run beside the curves."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from factory.cockpit.metric_panel import CELLS, NOT_RECORDED, _metric_panel_figure, metric_panel_png, panel_data
from factory.cockpit.plots import DPI
from factory.config import TaskSpec, parse_spec
from factory.core.loop import _record
from factory.core.producers.common import make_group
from factory.core.rollout.base import Completion
from factory.envs import tasks
from factory.envs.workers import Episode, LocalEnvironment
from factory.runs.step_rows import StepLog

RUN = "panel-run"
SPEC = parse_spec({"seed": 0, "model": {"preset": "micro"}, "task": {"name": "arithmetic", "n_train": 16,
                                                                      "n_eval": 8}})
# Per step: (loss, kl, entropy, grad_norm, clip_frac); a NaN loss is a step skipped for a non-finite loss.
TRAINER = [(0.50, 0.010, 2.6, 1.5, 0.00), (0.40, 0.020, 2.5, 1.2, 0.10), (float("nan"), 0.030, 2.4, 0.9, 0.20)]
GENERATED = [[4, 6], [3, 3], [8, 2]]  # tokens each of the step's two completions generated


def _step(step: int, lengths: list[int]):
    """One trainer step's record of real scored completions: a problem of the arithmetic task, one right answer
    and one wrong, scored by the real environment, with `lengths` generated tokens each."""
    problem = tasks.make_task_splits(TaskSpec(name="arithmetic", n_train=16, n_eval=8), 0).train[step]
    texts = [problem.answer, problem.answer + "9"]
    (scored,) = LocalEnvironment(None).score([Episode(f"e{step}", problem, texts)])
    comps = [Completion([1, 2], list(range(3, 3 + n)), [-0.5] * n, t, "stop", step) for t, n in zip(
        texts, lengths, strict=True)]
    loss, kl, entropy, grad_norm, clip = TRAINER[step]
    return _record(SPEC, step, [make_group(problem, step, comps, scored)], torch.tensor(scored.rewards),
                   {"loss": loss, "kl": kl, "entropy": entropy, "grad_norm": grad_norm, "clip_frac": clip},
                   0.0, 2.0, 0.5, {})


@pytest.fixture
def trained(lake) -> list[dict]:
    """Three steps of one run in the lake, as the trainer records them; the step rows read back."""
    log = StepLog(RUN, attempt=1)
    for step, lengths in enumerate(GENERATED):
        log.add(_step(step, lengths))
    log.flush(lake)
    return lake.read("steps").to_pylist()


GAP_CELLS = ["sampler/trainer gap: mean |Δ log-prob|", "sampler/trainer KL (k3)", "correction (TIS / MIS / IcePop)"]


def test_every_cell_has_the_runs_values_by_step(trained):
    cells = {c.cell.title: c for c in panel_data(trained)}
    assert list(cells) == [c.title for c in CELLS] == [
        "reward / accuracy (train)", "loss", "KL to reference", "entropy", "gradient norm", "clip fraction",
        "staleness (weight versions)", "response length (tokens)", "tokens/s", *GAP_CELLS]
    # `_record` measures no gap (the loop fills it after): those cells say so
    assert [t for t, c in cells.items() if not c.recorded] == GAP_CELLS
    steps = [1, 2, 3]
    assert cells["reward / accuracy (train)"].series == {"reward mean": (steps, [0.5] * 3),
                                                         "accuracy": (steps, [0.5] * 3)}
    # the NaN loss of step 3 is left out of its line and counted, not drawn as a gap nobody explains
    assert cells["loss"].series == {"loss": ([1, 2], [0.5, 0.4])} and cells["loss"].non_finite == 1
    assert cells["KL to reference"].series == {"kl": (steps, [0.010, 0.020, 0.030])}
    assert cells["entropy"].series == {"entropy": (steps, [2.6, 2.5, 2.4])}
    assert cells["gradient norm"].series == {"grad norm": (steps, [1.5, 1.2, 0.9])}
    assert cells["clip fraction"].series == {"clip fraction": (steps, [0.0, 0.1, 0.2])}
    assert cells["staleness (weight versions)"].series == {"mean": (steps, [0.0] * 3), "max": (steps, [0.0] * 3)}
    assert cells["response length (tokens)"].series == {"mean": (steps, [5.0, 3.0, 5.0])}
    assert cells["tokens/s"].series == {"generated tokens/s": (steps, [5.0, 3.0, 5.0])}  # 10, 6, 10 tokens in 2 s


def test_a_metric_the_run_did_not_record_says_so(trained):
    """A run trained before `response_tokens_mean` existed (its rows have None there): the cell is drawn and says
    "not recorded", and the other cells keep their data."""
    old = [{**r, "response_tokens_mean": None, "kl": None} for r in trained]
    cells = {c.cell.title: c for c in panel_data(old)}
    assert [t for t, c in cells.items() if not c.recorded] == ["KL to reference", "response length (tokens)",
                                                               *GAP_CELLS]
    fig = _metric_panel_figure(old, "old run")
    drawn = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes if ax.get_visible()}
    assert len(drawn) == len(CELLS)
    # reward and accuracy are the same numbers with binary rewards: one line that says so
    (reward,) = [ax for ax in fig.axes if ax.get_title() == "reward / accuracy (train)"]
    assert [ln.get_label() for ln in reward.get_lines()] == ["reward mean = accuracy"]
    assert drawn["KL to reference"] == [NOT_RECORDED] and drawn["response length (tokens)"] == [NOT_RECORDED]
    assert drawn["loss (1 non-finite left out)"] == [] and drawn["entropy"] == []


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    return struct.unpack(">II", png[16:24])


def test_the_panel_fits_a_page_1000_px_wide_and_its_bytes_depend_only_on_the_rows(trained):
    png = metric_panel_png(trained, "panel-run")
    assert _png_size(png) == (1000, 960)
    # drawn inside the Dagster UI, whose metadata value column is about 600 px wide beside an asset page's sidebar
    assert _png_size(metric_panel_png(trained, inline=True)) == (576, 640)
    shuffled = list(trained)
    random.Random(0).shuffle(shuffled)
    assert metric_panel_png(shuffled, "panel-run", dpi=DPI) == png


def test_rows_of_two_runs_or_none_are_refused(trained):
    with pytest.raises(ValueError, match="rows from 2 runs"):
        panel_data([*trained, {**trained[0], "run_id": "other"}])
    with pytest.raises(ValueError, match="no steps rows"):
        metric_panel_png([])


def test_metrics_not_measured_are_not_recorded_anywhere(lake, tmp_path):
    """A run with `kl_coef: 0` computes no KL, an arithmetic task runs no reward-hack detector and GRPO filters no
    group: the loss reports no `kl`, and the step's record holds None for each (not a 0 that reads as measured), so
    the lake's `steps` row holds NULL, MLflow gets no point, and the panel's KL cell says "not recorded"."""
    from factory.cockpit.tracking import Tracker
    from factory.core.algorithms import make_loss
    from factory.core.batch import pack
    from factory.home import factory_home
    from factory.runs.step_metrics import StepMetrics

    batch = pack([[1, 2]], [[3, 4]], 0, {"old_logprobs": [[-0.5, -0.5]]}, {"advantages": [1.0]})
    batch.per_token["ref_logprobs"] = torch.full_like(batch.per_token["old_logprobs"], -0.7)
    logp = batch.per_token["old_logprobs"]
    _, off = make_loss(SPEC.algorithm)(logp, batch)  # kl_coef 0: the reference is not used
    off = {k: float(v) for k, v in off.items()}  # 0-dim tensors, read on the host as a trainer's step does
    _, on = make_loss(SPEC.algorithm.model_copy(update={"kl_coef": 0.1}))(logp, batch)
    assert "kl" not in off and on["kl"] > 0
    problem = tasks.make_task_splits(TaskSpec(name="arithmetic", n_train=16, n_eval=8), 0).train[0]
    texts = [problem.answer, problem.answer + "9"]
    (scored,) = LocalEnvironment(None).score([Episode("e0", problem, texts)])
    comps = [Completion([1, 2], [3, 4], [-0.5, -0.5], t, "stop", 0) for t in texts]
    record = _record(SPEC, 0, [make_group(problem, 0, comps, scored)], torch.tensor(scored.rewards),
                     {**off, "loss": 0.5, "entropy": 2.0, "grad_norm": 1.0}, 0.0, 2.0, 0.5, {})
    assert record.kl is None and record.filtered is None
    assert (record.hacks_any, record.hacks_marker, record.hacks_early_exit, record.hacks_touched_tests) == (None,) * 4
    log = StepLog(RUN, attempt=1)
    log.add(record)
    log.flush(lake)
    (row,) = lake.read("steps").to_pylist()
    assert row["kl"] is None and row["hacks_any"] is None and row["loss"] == 0.5
    tracker = Tracker(factory_home(tmp_path / "mlflow-home"))
    mlflow_id = tracker.start_run("not-recorded", RUN)
    metrics = StepMetrics(tracker, mlflow_id)
    metrics.add(record.step, {k: v for k, v in record.to_dict().items() if k != "step"})
    metrics.flush()
    logged = tracker.client.get_run(mlflow_id).data.metrics
    assert "batch/loss" in logged and not {"kl", "batch/kl", "hacks_any", "filtered"} & set(logged)
    (kl_cell,) = [c for c in panel_data([row]) if c.cell.title == "KL to reference"]
    assert not kl_cell.recorded


def test_the_gap_cells_draw_the_steps_gap_and_corrections(lake):
    """Steps whose gap the loop measured (StepRecord fields set as the loop sets them), through StepLog into the real
    lake: the gap's cells have their figures by step; a step that measured none is a hole in the line, not a 0; a run
    that measured none at all says "not recorded" in each gap cell."""
    from tests.gap_records import GAP, gap_record

    log = StepLog(RUN, attempt=1)
    for r in (gap_record(1), gap_record(2), gap_record(3), gap_record(4, measured=False)):
        log.add(r)
    log.flush(lake)
    rows = lake.read("steps").to_pylist()
    cells = {c.cell.title: c for c in panel_data(rows)}
    steps = [1, 2, 3]
    assert cells["sampler/trainer gap: mean |Δ log-prob|"].series == {"mean |Δ|": (steps, [g[0] for g in GAP])}
    assert cells["sampler/trainer KL (k3)"].series == {"KL(sampler || trainer)": (steps, [g[1] for g in GAP])}
    assert cells["correction (TIS / MIS / IcePop)"].series == {
        "tokens masked": (steps, [0.0, 0.05, 0.10]), "sequences masked": (steps, [0.0, 0.0125, 0.025]),
        "mean weight": (steps, [1.0, 0.97, 0.93])}
    fig = _metric_panel_figure(rows, "gap run")
    (kl,) = [ax for ax in fig.axes if ax.get_title() == "sampler/trainer KL (k3)"]
    assert [list(ln.get_ydata()) for ln in kl.get_lines()] == [[g[1] for g in GAP]] and not list(kl.texts)
    (corr,) = [ax for ax in fig.axes if ax.get_title() == "correction (TIS / MIS / IcePop)"]
    assert corr.get_ylim() == (-0.03, 1.03)  # shares and a mean weight within [0, 1]: on the unit frame
    assert _png_size(metric_panel_png(rows)) == (1000, 960)

    unmeasured = [{**r, **dict.fromkeys(("gap_abs_mean", "gap_kl", "correction_masked_tokens",
                                         "correction_masked_seqs", "correction_weight_mean"))} for r in rows]
    fig = _metric_panel_figure(unmeasured, "old run")
    drawn = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes if ax.get_visible()}
    assert [drawn[t] for t in GAP_CELLS] == [[NOT_RECORDED]] * 3
