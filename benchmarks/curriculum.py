"""Uniform blend vs online filtering vs priority vs a level curriculum, on a mix where most prompts teach the warm
start nothing.

The warm start is the quickstart's: the tiny model after SFT on reversed 3-digit additions until it solves a
quarter of a train sample (greedily). GRPO then trains on a blend of three sources with equal weights:

- `mid`: the quickstart's 3-digit training split, which it solves sometimes (the learnable level);
- `hard`: 5-digit additions and `harder`: 6-digit ones, which it never saw and never solves (groups all wrong:
  zero advantage).

So two thirds of the uniform blend's rollouts teach nothing. (A level the warm start "already solves" would be
the other classic waste, but at temperature 1 this model does not get any level right in all 8 samples of a
group even where its greedy accuracy is 95% (measured: 1 of 1000 2-digit additions after SFT to 95% greedy), so
such groups still carry signal here; the unreachable levels are the waste this model has.)

Each variant trains the same number of trainer steps (same prompts per step, same group size) from the same warm
start: `uniform` (the blend as weighted), `online` (a prompt is dropped once a group of it was all right or all
wrong, tried again after --retry-after draws), `priority` (prompts seen before are generated with probability
max(floor, 4p(1-p))), `level` (the weight on one source at a time, easy, mid, hard, moving on when its rolling
accuracy reaches --threshold: mid, hard, harder). Held-out accuracy is the greedy accuracy on the quickstart's
held-out split (--n-eval unseen 3-digit problems), measured every --eval-every steps.

Printed per variant (means over seeds): final held-out accuracy, steps to reach the uniform run's final held-out
accuracy (per seed, the first eval at or above it) as a share of the run's steps, and the share of generated
tokens that carried a non-zero advantage. The best curriculum is the one with the lowest steps ratio.

    .venv/bin/python benchmarks/curriculum.py             # 3 seeds, 40 steps: ~10 min on 2 CPU cores
    .venv/bin/python benchmarks/curriculum.py --quick     # 1 seed, 20 steps

Last line, JSON: accuracy_uniform, accuracy_curriculum (the best curriculum's), best_curriculum,
steps_ratio_vs_uniform, useful_token_share_uniform, useful_token_share_curriculum, and the same per variant.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from factory.config import apply_overrides, load_spec  # noqa: E402
from factory.core.evaluate import evaluate  # noqa: E402
from factory.core.loop import train_rl  # noqa: E402
from factory.core.rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from factory.core.sft import run_sft  # noqa: E402
from factory.data.feed import make_feed  # noqa: E402
from factory.data.from_spec import open_sources  # noqa: E402
from factory.data.sources.base import ListSource  # noqa: E402
from factory.envs.tasks import make_task_splits  # noqa: E402
from factory.models.build import build_model  # noqa: E402
from factory.models.tokenizer import tokenizer_for  # noqa: E402
from factory.problem import Problem  # noqa: E402

SOURCES = ("mid", "hard", "harder")
DIGITS = (3, 5, 6)


def curricula(args: argparse.Namespace) -> dict[str, dict]:
    return {
        "uniform": {},
        "online": {"kind": "online", "attempts": 1, "drop": "both", "retry_after": args.retry_after},
        "priority": {"kind": "priority", "floor": 0.05},
        "level": {"kind": "level", "levels": list(SOURCES), "threshold": args.threshold, "window": args.window,
                  "review": 0.1},
    }


def base_spec(args: argparse.Namespace, seed: int):
    """The quickstart, with a data section of the three sources (`mid`'s entry only names it: `sources` below
    gives it the task's training split)."""
    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml")
    entry = {"kind": "arithmetic", "op": "add", "n": args.hard_n, "reverse_operands": True, "seed": seed}
    return apply_overrides(spec, {
        "name": "curriculum-bench", "seed": seed, "task.n_eval": args.n_eval, "schedule.steps": args.steps,
        "model.max_positions": 64,
        "schedule.mode": "sync", "trainer.threads": 1,
        "data": {"sources": [{**entry, "name": n, "digits": d} for n, d in zip(SOURCES, DIGITS, strict=True)],
                 "weights": dict.fromkeys(SOURCES, 1.0), "held_out": 0}})


def sources(spec, three: list) -> list:
    """mid: the 3-digit training split (the quickstart's, so the held-out split is disjoint from it); hard and
    harder as the spec's entries say."""
    mid = [Problem(p.id, p.prompt, p.answer, p.op, p.digits, {"source": "mid", "verifier": "arithmetic"})
           for p in three]
    return [ListSource("mid", mid, f"mid-{spec.seed}"), *open_sources(spec.resolved.blend)[1:]]


def held_out_accuracy(model, tok, held: list, max_new_tokens: int) -> float:
    return evaluate(EmbeddedEngine(model, tok), tok, held, max_new_tokens).accuracy


def run_variant(spec, curriculum: dict, start, tok, held: list, srcs: list, every: int) -> dict:
    s = apply_overrides(spec, {"data.curriculum": curriculum})
    model = copy.deepcopy(start)
    curve = [(0, held_out_accuracy(model, tok, held, s.rollout.max_new_tokens))]
    tokens = useful = 0

    def on_step(r) -> None:
        nonlocal tokens, useful
        tokens += sum(x["tokens"] for x in r.sources)
        useful += sum(x["useful_tokens"] for x in r.sources)
        if r.step % every == 0 or r.step == s.schedule.steps:
            curve.append((r.step, held_out_accuracy(model, tok, held, s.rollout.max_new_tokens)))
            model.train()

    t0 = time.perf_counter()
    records = train_rl(s, model, tok, [], on_step=on_step, feed=make_feed(s.resolved.blend, sources=srcs))
    return {"curve": curve, "final": curve[-1][1], "useful_token_share": useful / max(tokens, 1),
            "wall_s": time.perf_counter() - t0, "skipped": records[-1].data.get("data/skipped", 0.0)}


def steps_to(curve: list, target: float) -> int | None:
    return next((step for step, acc in curve if acc >= target - 1e-9), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one seed, 20 steps")
    ap.add_argument("--seeds", type=int, default=None, help="default 3 (quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 40, quick 20)")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--variants", default="uniform,online,priority,level")
    ap.add_argument("--hard-n", type=int, default=64, help="rows of each unreachable source")
    ap.add_argument("--n-eval", type=int, default=300, help="held-out problems")
    ap.add_argument("--retry-after", type=int, default=2000, help="online: draws before a dropped prompt returns")
    ap.add_argument("--threshold", type=float, default=0.8, help="level: rolling accuracy that moves on")
    ap.add_argument("--window", type=int, default=32, help="level: groups in the rolling accuracy")
    args = ap.parse_args(argv)
    steps = args.steps or (20 if args.quick else 40)
    args.steps = steps
    seeds = args.seeds or (1 if args.quick else 3)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(curricula(args)))
    if unknown or "uniform" not in variants:
        ap.error(f"--variants: unknown {unknown} or no 'uniform' (choose from {', '.join(curricula(args))})")
    torch.set_num_threads(1)

    tok = tokenizer_for("arithmetic")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for seed in range(seeds):
        spec = base_spec(args, seed)
        splits = make_task_splits(spec.task, seed)
        three, held = splits.train, splits.eval
        t0 = time.perf_counter()
        start = build_model(spec.model.preset, tok, seed=seed)
        sft = run_sft(start, tok, three, spec.sft, seed, max_new_tokens=spec.rollout.max_new_tokens)
        sft_steps, sft_acc = int(sft["steps"]), sft.get("train_accuracy", 0.0)
        srcs = sources(spec, three)
        acc0 = held_out_accuracy(start, tok, held, spec.rollout.max_new_tokens)
        print(f"seed {seed}: warm start after {sft_steps} SFT steps ({time.perf_counter() - t0:.0f}s): train "
              f"{sft_acc:.2f}, held-out {acc0:.3f}; sources " + ", ".join(f"{s.name} {len(s)}" for s in srcs),
              flush=True)
        for v in variants:
            r = run_variant(spec, curricula(args)[v], start, tok, held, srcs, args.eval_every)
            results[v].append(r)
            print(f"  {v:>9}: held-out {r['final']:.3f}, useful tokens {r['useful_token_share']:.2f}, "
                  f"skipped {r['skipped']:.0f}, {r['wall_s']:.0f}s", flush=True)

    def ratio(v: str, first_hit: bool = False) -> float:
        """Mean over seeds of (steps to reach uniform's final accuracy) / steps (the issue's measure); with
        `first_hit`, divided by the steps uniform itself took to first reach it instead (stricter where uniform
        plateaus before its last step). Not reached counts as 1 + 1/steps (it would take more than the run)."""
        out = []
        for r, u in zip(results[v], results["uniform"], strict=True):
            hit = steps_to(r["curve"], u["final"])
            base = steps_to(u["curve"], u["final"]) if first_hit else steps
            out.append(hit / base if hit is not None else 1 + 1 / steps)
        return statistics.mean(out)

    summary = {v: {"accuracy": statistics.mean(r["final"] for r in results[v]),
                   "accuracy_sd": statistics.stdev([r["final"] for r in results[v]]) if seeds > 1 else 0.0,
                   "steps_ratio": ratio(v), "steps_ratio_first_hit": ratio(v, first_hit=True),
                   "useful_token_share": statistics.mean(r["useful_token_share"] for r in results[v])}
               for v in variants}
    print(f"\n{steps} steps x {spec.rollout.prompts_per_step} prompts x {spec.algorithm.group_size} samples, "
          f"{seeds} seed(s), held-out: {args.n_eval} unseen 3-digit problems")
    print(f"{'variant':>9} {'held-out acc':>14} {'steps to uniform final':>23} {'vs uniform first hit':>21} "
          f"{'useful tokens':>14}")
    for v, m in summary.items():
        print(f"{v:>9} {m['accuracy']:9.3f} ±{m['accuracy_sd']:.3f} {m['steps_ratio']:22.2f}x "
              f"{m['steps_ratio_first_hit']:20.2f}x {m['useful_token_share']:14.2f}")
    curricula_run = [v for v in variants if v != "uniform"]
    best = min(curricula_run, key=lambda v: (summary[v]["steps_ratio"], -summary[v]["accuracy"])) \
        if curricula_run else "uniform"
    out = {"accuracy_uniform": round(summary["uniform"]["accuracy"], 4),
           "accuracy_curriculum": round(summary[best]["accuracy"], 4), "best_curriculum": best,
           "steps_ratio_vs_uniform": round(summary[best]["steps_ratio"], 4),
           "steps_ratio_vs_uniform_first_hit": round(summary[best]["steps_ratio_first_hit"], 4),
           "useful_token_share_uniform": round(summary["uniform"]["useful_token_share"], 4),
           "useful_token_share_curriculum": round(summary[best]["useful_token_share"], 4),
           "seeds": seeds, "steps": steps,
           "variants": {v: {k: round(x, 4) for k, x in m.items()} for v, m in summary.items()}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
