"""Does the sampler/trainer gap matter, and do the corrections help? The same GRPO run in arms, on this CPU.

The quickstart (examples/quickstart.yaml), warm-started once by SFT (the cached warm start of `runs/stages.py`,
shared by every arm and seed), then trained by GRPO for --steps steps in each arm:

- clean: the engine samples from the trainer's own weights (behaviour log-probs = the trainer's, up to fp32 noise);
- mismatched: the engine samples from the trainer's weights rounded to bf16 (`rollout.round_weights: bf16`, a
  lower-precision engine's gap reproduced on the CPU), the loss trusting the sampler's log-probs
  (`algorithm.behavior: rollout`): uncorrected;
- recompute: mismatched, the loss's behaviour log-probs the trainer's own recomputed ones, no correction;
- tis_token / tis_seq: recompute + truncated IS on the sampler/trainer ratio, per token / per sequence, cap C = 2
  (verl's `decoupled_token_is` / `decoupled_seq_is` presets, rollout_is_threshold 2.0);
- mis: recompute + masked IS, sequences whose geometric-mean ratio leaves [0.999, 1.001] dropped (verl's
  `decoupled_geo_rs` preset: rollout_rs geometric, thresholds 0.999 / 1.001);
- icepop: recompute + IcePop, tokens whose ratio leaves [0.5, 5.0] masked (the IcePop paper's bounds).

Every arm has `algorithm.dual_clip: off`, so the dual clip (on by default wherever a gap can occur) does not mask
what the corrections do. Per arm and seed: greedy held-out accuracy on the task's eval split (Wilson 95% interval,
n problems), and the gap per step from the run's StepRecords (gap_abs_mean, gap_kl: the trainer's log-probs of
every batch against the sampler's; `logprob_mismatch`, the old per-step probe, beside them). Prints a table per arm
(seed-mean accuracy with its t interval over seeds, pooled Wilson interval over seeds x problems, Newcombe's
interval of the difference from clean, pooling problems, and Welch's over the seeds' accuracies, which counts the
seed-to-seed spread), writes the picture (--plot, default docs/mismatch.png) and a last line of
JSON.

    .venv/bin/python benchmarks/mismatch.py                      # 7 arms x 3 seeds (~17 min on 2 busy cores)
    .venv/bin/python benchmarks/mismatch.py --quick              # 3 arms x 1 seed, 3 steps: the harness works
    .venv/bin/python benchmarks/mismatch.py --cost               # the recompute's cost per step instead

`--cost`: the recompute's cost per step, behaviour `rollout` vs `recompute` (no rounding, no correction), on the
quickstart (from the same warm start) and on SmolLM2-135M (examples/smollm2_reasoning.yaml, no SFT): seconds of the
trainer's own log-prob passes per step (`StepRecord.recompute_s`) and their share of the step's wall time, the
first step left out (warm-up). Set FACTORY_HOME to keep the warm start (and SmolLM2's converted weights) between
invocations; without it a temporary home is used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from factory.config import apply_overrides, load_spec, parse_overrides  # noqa: E402
from factory.core.evaluate import evaluate  # noqa: E402
from factory.core.loop import train_rl  # noqa: E402
from factory.core.rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from factory.home import factory_home  # noqa: E402
from factory.intervals import Accuracy, mean_interval, newcombe, welch, wilson  # noqa: E402
from factory.models.checkpoint import load_checkpoint  # noqa: E402
from factory.runs.stages import build_dataset, cached_sft_checkpoint, load_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMOLLM2 = ROOT / "examples" / "smollm2_reasoning.yaml"

_MISMATCHED = {"rollout.round_weights": "bf16", "algorithm.dual_clip": "off"}
_RECOMPUTED = {**_MISMATCHED, "algorithm.behavior": "recompute"}
ARMS: dict[str, dict[str, Any]] = {
    "clean": {"algorithm.dual_clip": "off", "algorithm.behavior": "rollout"},
    "mismatched": {**_MISMATCHED, "algorithm.behavior": "rollout"},
    "recompute": {**_RECOMPUTED, "algorithm.correction.tis": "off"},
    "tis_token": {**_RECOMPUTED, "algorithm.correction.tis": "token", "algorithm.correction.tis_cap": 2.0},
    "tis_seq": {**_RECOMPUTED, "algorithm.correction.tis": "sequence", "algorithm.correction.tis_cap": 2.0},
    "mis": {**_RECOMPUTED, "algorithm.correction.tis": "off", "algorithm.correction.mis": [0.999, 1.001]},
    "icepop": {**_RECOMPUTED, "algorithm.correction.tis": "off", "algorithm.correction.icepop": [0.5, 5.0]},
}
GAP_KEYS = ("gap_abs_mean", "gap_kl", "gap_abs_max", "gap_out_frac", "gap_seq_p95", "logprob_mismatch",
            "correction_weight_mean", "correction_masked_tokens", "correction_masked_seqs", "recompute_s")


def _field(record: Any, key: str) -> float | None:
    """A StepRecord field, None where this branch's records lack it or did not measure it."""
    v = getattr(record, key, None)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if vals else None


def run_arm(spec, ckpt: Path, splits, arm: str, seed: int) -> dict[str, Any]:
    """One GRPO run of `arm` from the warm start, then its greedy held-out accuracy."""
    s = apply_overrides(spec, {**ARMS[arm], "seed": seed})
    torch.manual_seed(seed)
    model, tok = load_checkpoint(ckpt)
    t0 = time.perf_counter()
    records = train_rl(s, model, tok, splits.train)
    wall = time.perf_counter() - t0
    res = evaluate(EmbeddedEngine(model.eval(), tok), tok, splits.eval, s.rollout.max_new_tokens)
    curves = {k: [_field(r, k) for r in records] for k in GAP_KEYS}
    return {"arm": arm, "seed": seed, "accuracy": res.accuracy, "n": res.n, "wall_s": wall,
            "reward_last": _mean([r.reward_mean for r in records[-max(1, len(records) // 4):]]),
            "steps": len(records), "curves": curves,
            **{f"{k}_mean": _mean(v) for k, v in curves.items()}}


def _fmt(v: float | None, spec: str = ".2e") -> str:
    return "—" if v is None else format(v, spec)


def summarize(rows: list[dict], arms: list[str]) -> dict[str, dict[str, Any]]:
    """Per arm: seed accuracies, their mean and t interval, the pooled Wilson interval, the difference from clean."""
    out: dict[str, dict[str, Any]] = {}
    base = [r for r in rows if r["arm"] == "clean"]
    kb, nb = sum(Accuracy(r["accuracy"], r["n"]).k for r in base), sum(r["n"] for r in base)
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        accs = [r["accuracy"] for r in mine]
        k, n = sum(Accuracy(r["accuracy"], r["n"]).k for r in mine), sum(r["n"] for r in mine)
        pooled = wilson(k, n)
        seed_ci = mean_interval(accs) if len(accs) > 1 else None
        diff = newcombe(k, n, kb, nb) if base and arm != "clean" else None
        # Welch over the seeds' accuracies: seed-to-seed variation included (Newcombe's pools problems as if
        # independent, which a trained model's seeds are not)
        seeds_diff = welch(accs, [r["accuracy"] for r in base]) if arm != "clean" and min(len(accs), len(base)) > 1 \
            else None
        out[arm] = {"accuracy_by_seed": accs, "accuracy_mean": statistics.fmean(accs), "n_per_seed": mine[0]["n"],
                    "seeds": len(mine), "seed_mean_ci95": None if seed_ci is None else [seed_ci.low, seed_ci.high],
                    "pooled_ci95": [pooled.low, pooled.high], "pooled_n": n,
                    "diff_vs_clean": None if diff is None else k / n - kb / nb,
                    "diff_vs_clean_ci95": None if diff is None else [diff.low, diff.high],
                    "diff_vs_clean_welch_ci95": None if seeds_diff is None else [seeds_diff.low, seeds_diff.high],
                    **{f"{key}_mean": _mean([r[f"{key}_mean"] for r in mine]) for key in GAP_KEYS},
                    "wall_s_mean": statistics.fmean(r["wall_s"] for r in mine)}
    return out


def print_table(summary: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'arm':>11} {'held-out acc (seed mean) [t 95%]':>34} {'pooled [Wilson 95%] n':>27} "
          f"{'vs clean [Newcombe 95%]':>26} {'[Welch, seeds]':>17} {'|gap| mean':>10} {'gap KL':>9} {'probe':>9} "
          f"{'masked tok':>10} {'IS w':>6} {'wall s':>7}")
    for arm, s in summary.items():
        ci = s["seed_mean_ci95"]
        seed_txt = f"{s['accuracy_mean']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        pooled = f"{s['accuracy_mean']:.3f} [{s['pooled_ci95'][0]:.3f}, {s['pooled_ci95'][1]:.3f}] {s['pooled_n']}"
        d = s["diff_vs_clean_ci95"]
        diff = "—" if d is None else f"{s['diff_vs_clean']:+.3f} [{d[0]:+.3f}, {d[1]:+.3f}]"
        w = s["diff_vs_clean_welch_ci95"]
        seeds = "—" if w is None else f"[{w[0]:+.3f}, {w[1]:+.3f}]"
        print(f"{arm:>11} {seed_txt:>34} {pooled:>27} {diff:>26} {seeds:>17} {_fmt(s['gap_abs_mean_mean']):>10} "
              f"{_fmt(s['gap_kl_mean']):>9} {_fmt(s['logprob_mismatch_mean']):>9} "
              f"{_fmt(s['correction_masked_tokens_mean'], '.3f'):>10} "
              f"{_fmt(s['correction_weight_mean_mean'], '.3f'):>6} "
              f"{s['wall_s_mean']:7.0f}")


def plot(rows: list[dict], summary: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Held-out accuracy per arm (seeds as dots, pooled Wilson interval as a bar) and the gap per step per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    fig, (ax_acc, ax_gap, ax_kl) = plt.subplots(1, 3, figsize=(13, 3.8))
    for i, arm in enumerate(arms):
        s = summary[arm]
        lo, hi = s["pooled_ci95"]
        ax_acc.errorbar(i, s["accuracy_mean"], yerr=[[s["accuracy_mean"] - lo], [hi - s["accuracy_mean"]]],
                        fmt="s", color=f"C{i}", capsize=4)
        ax_acc.scatter([i] * len(s["accuracy_by_seed"]), s["accuracy_by_seed"], color=f"C{i}", s=10, alpha=0.6)
    ax_acc.set_xticks(range(len(arms)), arms, rotation=35, ha="right", fontsize=8)
    ax_acc.set_ylabel("greedy held-out accuracy")
    ax_acc.set_title("accuracy (dots: seeds; bar: pooled Wilson 95%)", fontsize=9)
    for ax, key, label in ((ax_gap, "gap_abs_mean", "mean |Δ log-prob| per token"),
                           (ax_kl, "gap_kl", "k3 KL(sampler ‖ trainer) per token")):
        drawn = False
        for i, arm in enumerate(arms):
            series = [r["curves"][key] for r in rows if r["arm"] == arm]
            steps = max((len(c) for c in series), default=0)
            ys = [_mean([c[t] for c in series if t < len(c)]) for t in range(steps)]
            pts = [(t + 1, y) for t, y in enumerate(ys) if y is not None and y > 0]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=f"C{i}", label=arm, lw=1.2)
                drawn = True
        if key == "gap_abs_mean":  # what a bf16 GPU engine shows against its trainer (the issue's figures)
            ax.axhspan(0.005, 0.02, color="0.85", zorder=0, label="GPU bf16 engine, typical")
        ax.set_xlabel("GRPO step")
        ax.set_title(label + " (seed mean)", fontsize=9)
        if drawn:
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured on this branch", ha="center", transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _warm_start(steps: int, n_eval: int):
    spec = apply_overrides(load_spec(QUICKSTART), parse_overrides([
        f"schedule.steps={steps}", f"task.n_eval={n_eval}", "trainer.threads=1", "name=mismatch-bench"]))
    paths = factory_home(os.environ.get("FACTORY_HOME") or tempfile.mkdtemp(prefix="mismatch-bench-"))
    splits = load_dataset(build_dataset(spec, paths).path)
    t0 = time.perf_counter()
    sft = cached_sft_checkpoint(spec, paths, splits, log=lambda _: None)
    print(f"SFT warm start: {sft.steps} steps, held-out accuracy {sft.accuracy:.3f} "
          f"({time.perf_counter() - t0:.0f} s; cached in {paths.checkpoints})", flush=True)
    return spec, splits, sft


def arms_main(args: argparse.Namespace) -> dict[str, Any]:
    spec, splits, sft = _warm_start(args.steps, args.n_eval)
    rows = []
    t_all = time.perf_counter()
    for seed in range(args.seeds):
        for arm in args.arms:
            r = run_arm(spec, sft.checkpoint.path, splits, arm, seed)
            rows.append(r)
            print(f"  {arm:>11} seed {seed}: acc {Accuracy(r['accuracy'], r['n']).text()}  "
                  f"|gap| {_fmt(r['gap_abs_mean_mean'])}  KL {_fmt(r['gap_kl_mean'])}  "
                  f"probe {_fmt(r['logprob_mismatch_mean'])}  reward(last quarter) {r['reward_last']:.3f}  "
                  f"{r['wall_s']:.0f} s", flush=True)
    summary = summarize(rows, args.arms)
    print_table(summary)
    print(f"\n{args.seeds} seed(s) x {len(args.arms)} arms, {args.steps} GRPO steps each from one SFT warm start "
          f"(held-out {sft.accuracy:.3f}); {spec.rollout.prompts_per_step} prompts x {spec.algorithm.group_size} "
          f"samples a step; all {time.perf_counter() - t_all:.0f} s")
    if args.plot:
        plot(rows, summary, args.plot, f"quickstart, {args.steps} GRPO steps from one SFT warm start, "
             f"{args.seeds} seeds; engine weights rounded to bf16 except 'clean'")
        print(f"picture: {args.plot} ({args.plot.stat().st_size // 1024} KB)")
    return {"mode": "arms", "steps": args.steps, "seeds": args.seeds, "n_eval": args.n_eval,
            "sft_accuracy": sft.accuracy, "arms": summary,
            "gap_abs_mean_bf16": summary.get("mismatched", {}).get("gap_abs_mean_mean"),
            "gap_abs_mean_clean": summary.get("clean", {}).get("gap_abs_mean_mean")}


def _cost_of(records: list) -> dict[str, Any]:
    """Per-step recompute seconds and wall seconds, the first step left out (warm-up)."""
    rest = records[1:] or records
    rec = [_field(r, "recompute_s") for r in rest]
    wall = [r.wall_s for r in rest]
    shares = [a / w for a, w in zip(rec, wall, strict=True) if a is not None and w > 0]
    return {"steps": len(rest), "recompute_s": _mean(rec), "wall_s": statistics.fmean(wall),
            "share": _mean(shares)}


def cost_main(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": "cost"}
    spec, splits, sft = _warm_start(args.cost_steps + 1, args.n_eval)  # n_eval too: the arms' warm start
    for behavior in ("rollout", "recompute"):
        s = apply_overrides(spec, {"algorithm.behavior": behavior, "algorithm.correction.tis": "off"})
        model, tok = load_checkpoint(sft.checkpoint.path)
        out[f"quickstart_{behavior}"] = _cost_of(train_rl(s, model, tok, splits.train))
    if not args.no_smollm2:
        from benchmarks.real_model import load_spec_dict, rg_rows
        from factory.config import ExperimentSpec
        from factory.data.feed import feed_of
        from factory.models.build import policy_for

        raw, source, held = load_spec_dict(SMOLLM2, None)
        for behavior in ("rollout", "recompute"):
            s = ExperimentSpec.model_validate({**raw, "schedule": {**raw["schedule"], "steps": args.smollm2_steps + 1},
                                               "algorithm": {**raw["algorithm"], "behavior": behavior,
                                                             "correction": {"tis": "off"}}})
            train, _ = rg_rows(source, held)
            torch.manual_seed(0)
            model, tok = policy_for(s)
            records = train_rl(s, model, tok, train, feed=feed_of(train, seed=0, name=source["name"]))
            out[f"smollm2_{behavior}"] = _cost_of(records)
    print(f"\n{'run':>22} {'steps':>5} {'recompute s/step':>17} {'wall s/step':>12} {'share of step':>14}")
    for key, c in out.items():
        if isinstance(c, dict):
            print(f"{key:>22} {c['steps']:5d} {_fmt(c['recompute_s'], '.3f'):>17} {c['wall_s']:12.2f} "
                  f"{_fmt(c['share'], '.3f'):>14}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 60; quick 3)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 3; quick 1)")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=None, help="default: all (quick: clean, "
                    "mismatched, tis_token)")
    ap.add_argument("--n-eval", type=int, default=500, help="held-out problems (task.n_eval)")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "mismatch.png", help="the picture ('' for none)")
    ap.add_argument("--quick", action="store_true", help="a check that the harness works: 3 arms, 1 seed, 3 steps")
    ap.add_argument("--cost", action="store_true", help="measure the recompute's cost per step instead")
    ap.add_argument("--cost-steps", type=int, default=6, help="--cost: quickstart steps measured (after a warm-up)")
    ap.add_argument("--smollm2-steps", type=int, default=2, help="--cost: SmolLM2 steps measured (after a warm-up)")
    ap.add_argument("--no-smollm2", action="store_true", help="--cost: the quickstart only")
    args = ap.parse_args(argv)
    args.steps = args.steps or (3 if args.quick else 60)
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.arms = args.arms or (["clean", "mismatched", "tis_token"] if args.quick else list(ARMS))
    args.plot = args.plot if str(args.plot) not in ("", ".") else None
    if args.steps < 1 or args.seeds < 1:
        ap.error(f"--steps and --seeds: must be >= 1, got {args.steps} and {args.seeds}")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result = cost_main(args) if args.cost else arms_main(args)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["load_1min"] = os.getloadavg()[0]
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
