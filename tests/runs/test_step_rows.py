"""StepLog (factory/runs/step_rows.py) into a real Iceberg lake: a step's sampler/trainer gap lands in `steps` and each
source's in `step_sources` with the figures the loop recorded, and a step that measured none holds NULL there."""

from __future__ import annotations

from factory.lake.schemas import GAP_COLUMNS as GAP_STEP_COLUMNS
from factory.runs.step_rows import StepLog
from tests.gap_records import GAP, gap_record


def test_a_steps_gap_lands_in_steps_and_step_sources(lake):
    log = StepLog("gap-run", attempt=1)
    records = [gap_record(1), gap_record(2), gap_record(3, measured=False)]
    for r in records:
        log.add(r)
    log.flush(lake)
    steps = {r["step"]: r for r in lake.read("steps").to_pylist()}
    for r in records:
        assert {c: steps[r.step][c] for c in GAP_STEP_COLUMNS} == {c: getattr(r, c) for c in GAP_STEP_COLUMNS}
    assert [steps[s]["gap_kl"] for s in (1, 2, 3)] == [GAP[0][1], GAP[1][1], None]
    assert steps[2]["correction_masked_tokens"] == 0.05 and steps[3]["recompute_s"] is None
    sources = {(r["step"], r["source"]): (r["gap_abs_mean"], r["gap_kl"])
               for r in lake.read("step_sources").to_pylist()}
    assert sources == {(1, "arith"): (0.005, 5e-5), (1, "chain"): (0.02, 2e-4),
                       (2, "arith"): (0.01, 2e-4), (2, "chain"): (0.04, 8e-4),
                       (3, "arith"): (None, None), (3, "chain"): (None, None)}
