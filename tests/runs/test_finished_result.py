"""factory/runs/rl_run.py finished_result: a succeeded run's recorded result is its result as lake/results.py
defines it (held-out accuracy at the final evaluated step), whatever else was evaluated at that step."""

from __future__ import annotations

import datetime as dt

from factory.runs.rl_run import finished_result

T0 = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)


def test_a_finished_runs_result_is_its_held_out_accuracy_at_the_final_step(lake, tmp_path):
    ckpt = tmp_path / "final"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    lake.upsert("runs", [dict(run_id="q", name="q", status="succeeded", spec="{}", spec_fingerprint="f",
                              code_version="c", seed=0, started_at=T0, final_checkpoint=str(ckpt))])
    ev = dict(run_id="q", n=500, recorded_at=T0)
    lake.upsert("evals", [dict(ev, step=0, benchmark="arithmetic_heldout", metric="accuracy", value=0.744),
                          dict(ev, step=60, benchmark="arithmetic_heldout", metric="accuracy", value=0.764),
                          dict(ev, step=60, benchmark="arithmetic_heldout", metric="sft_control_accuracy",
                               value=0.9),
                          dict(ev, step=60, benchmark="carry_chains", metric="accuracy", value=0.8, n=200)])
    res = finished_result(lake, "q")
    assert (res.steps, res.start_accuracy, res.final_accuracy) == (60, 0.744, 0.764)
