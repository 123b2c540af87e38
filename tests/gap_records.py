"""Trainer steps with the sampler/trainer gap measured (the StepRecord fields of issue 35, set by hand as the loop
sets them), for the tests of where a step's metrics go: the lake, MLflow, the metric panel, the live sweep page."""

from __future__ import annotations

from dataclasses import MISSING, fields

from factory.core.loop import StepRecord

# Per step 1..3: gap_abs_mean, gap_kl, correction_masked_tokens, correction_weight_mean; the other gap fields follow.
GAP = [(0.010, 1e-4, 0.00, 1.00), (0.020, 4e-4, 0.05, 0.97), (0.040, 1.6e-3, 0.10, 0.93)]


def gap_record(step: int, measured: bool = True) -> StepRecord:
    """Step `step` (1-based) of a run: its required scalars at 0.5, and with `measured` the gap of GAP[step - 1], with
    two data sources each with its own gap; without, the gap fields None as a run that measured none records them."""
    required = [f.name for f in fields(StepRecord) if f.default is MISSING and f.default_factory is MISSING]
    r = StepRecord(**{**dict.fromkeys(required, 0.5), "step": step, "weight_version": step})
    r.sources = [dict(source="arith", groups=2, tokens=40), dict(source="chain", groups=1, tokens=12)]
    if not measured:
        r.sources = [dict(s, gap_abs_mean=None, gap_kl=None) for s in r.sources]
        return r
    abs_mean, kl, masked, weight = GAP[step - 1]
    r.gap_abs_mean, r.gap_abs_max, r.gap_kl, r.gap_out_frac = abs_mean, 10 * abs_mean, kl, masked / 2
    r.gap_seq_p95, r.gap_rows, r.recompute_s = 5 * abs_mean, 1.0, 0.25 * step
    r.correction_masked_tokens, r.correction_weight_mean, r.correction_masked_seqs = masked, weight, masked / 4
    r.sources = [dict(r.sources[0], gap_abs_mean=abs_mean / 2, gap_kl=kl / 2),
                 dict(r.sources[1], gap_abs_mean=abs_mean * 2, gap_kl=kl * 2)]
    return r
