"""Uniform blend vs online filtering vs a level curriculum, on a mix where most prompts teach the warm start nothing.

The tiny quickstart model is warm-started by SFT on the quickstart's 3-digit additions (reversed) with a fifth as
many 2-digit ones mixed in, until it solves --sft-stop of a sample of them: the 2-digit ones nearly all, the
3-digit ones sometimes. GRPO then trains on a blend of three sources with equal weights:

- `easy`: 2-digit additions, which the warm start already solves (groups all right: zero advantage);
- `mid`: 3-digit additions, which it solves sometimes (the learnable level);
- `hard`: 5-digit additions, which it never saw and never solves (groups all wrong: zero advantage).

Each variant trains the same number of trainer steps (same prompts per step, same group size) from the same warm
start: `uniform` (the blend as weighted), `online` (a prompt is dropped once a group of it was all right or all
wrong, and tried again after --retry-after draws), `priority` (prompts seen before are generated with
probability max(floor, 4p(1-p))), `level` (weight on one level at a time, easiest first, moving on when its
rolling accuracy reaches --threshold). Held-out accuracy is the greedy accuracy on 100 unseen problems of each
level (300 in all), measured every --eval-every steps.

Printed per variant (means over seeds): final held-out accuracy, steps to reach the uniform run's final held-out
accuracy (per seed, first eval at or above it) as a share of the run's steps, and the share of generated tokens
that carried a non-zero advantage. The best curriculum is the one with the lowest steps ratio.

    .venv/bin/python benchmarks/curriculum.py             # 3 seeds, 60 steps: ~25 min on 2 CPU cores
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
from factory.core.loop import train_grpo  # noqa: E402
from factory.core.rollout.embedded import EmbeddedEngine  # noqa: E402
from factory.core.sft import run_sft  # noqa: E402
from factory.data.blend import held_out_sets  # noqa: E402
from factory.data.feed import make_feed  # noqa: E402
from factory.data.sources import make_source  # noqa: E402
from factory.envs.tasks import make_task_splits  # noqa: E402
from factory.models.build import build_model  # noqa: E402
from factory.models.tokenizer import tokenizer_for  # noqa: E402

LEVELS = {"easy": 2, "mid": 3, "hard": 5}  # operand digits


def curricula(args: argparse.Namespace) -> dict[str, dict]:
    return {
        "uniform": {},
        "online": {"kind": "online", "attempts": 1, "drop": "both", "retry_after": args.retry_after},
        "priority": {"kind": "priority", "floor": 0.05},
        "level": {"kind": "level", "levels": list(LEVELS), "threshold": args.threshold, "window": args.window,
                  "review": 0.1},
    }


def base_spec(args: argparse.Namespace, seed: int):
    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml")
    sources = [{"name": name, "kind": "arithmetic", "op": "add", "digits": d, "n": n, "seed": seed,
                "reverse_operands": True}
               for (name, d), n in zip(LEVELS.items(), (args.easy_n, args.mid_n, args.hard_n), strict=True)]
    return apply_overrides(spec, {
        "name": "curriculum-bench", "seed": seed, "task.digits": [3], "task.n_train": 20000, "task.n_eval": 100,
        "sft.examples": None, "schedule.steps": args.steps,
        "schedule.mode": "sync", "trainer.threads": 1,
        "data": {"sources": sources, "weights": dict.fromkeys(LEVELS, 1.0), "held_out": 100}})


def warm_start(spec, tok, args: argparse.Namespace):
    """SFT on the task's 3-digit training problems with a fifth as many 2-digit ones mixed in, in chunks of
    --sft-chunk steps, until a sample of the *training* problems of each level is solved at least at --sft-easy
    (2-digit) and --sft-mid (3-digit): 2-digit additions are then solved, 3-digit ones sometimes."""
    model = build_model(spec.model.preset, tok, seed=spec.seed)
    three = make_task_splits(spec.task, spec.seed).train  # 3-digit: the task's split, as in the quickstart
    # 2-digit demonstrations: rows of the easy source's own order after its training and held-out rows, so none
    # is a held-out problem
    easy = next(s for s in spec.data.sources if s["name"] == "easy")
    demo = make_source({**easy, "name": "easy-sft", "start": easy["n"] + spec.data.held_out, "n": len(three) // 4})
    two = [p for b in range(-(-len(demo) // demo.block_rows)) for p in demo.read_block(b)]
    chunk = spec.sft.model_copy(update={"steps": args.sft_chunk, "stop_at_accuracy": None})
    t0, steps, acc = time.perf_counter(), 0, {}
    for i in range(args.sft_max // args.sft_chunk):
        run_sft(model, tok, three + two, chunk, spec.seed + i, max_new_tokens=spec.rollout.max_new_tokens)
        steps += args.sft_chunk
        acc = {"easy": evaluate(EmbeddedEngine(model, tok), tok, two[:200], spec.rollout.max_new_tokens).accuracy,
               "mid": evaluate(EmbeddedEngine(model, tok), tok, three[:200], spec.rollout.max_new_tokens).accuracy}
        if acc["easy"] >= args.sft_easy and acc["mid"] >= args.sft_mid:
            break
    return model, steps, time.perf_counter() - t0


def held_out_accuracy(model, tok, held: dict, max_new_tokens: int) -> dict[str, float]:
    out = {name: evaluate(EmbeddedEngine(model, tok), tok, problems, max_new_tokens).accuracy
           for name, problems in held.items()}
    out["all"] = statistics.mean(out[n] for n in held)
    return out


def run_variant(spec, curriculum: dict, start, tok, held: dict, every: int) -> dict:
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
    records = train_grpo(s, model, tok, [], on_step=on_step, feed=make_feed(s))
    return {"curve": curve, "final": curve[-1][1], "useful_token_share": useful / max(tokens, 1),
            "wall_s": time.perf_counter() - t0, "skipped": records[-1].data.get("data/skipped", 0.0),
            "level": records[-1].data.get("curriculum/level")}


def steps_to(curve: list, target: float) -> int | None:
    return next((step for step, acc in curve if acc["all"] >= target - 1e-9), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one seed, 20 steps")
    ap.add_argument("--seeds", type=int, default=None, help="default 3 (quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 60, quick 20)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--variants", default="uniform,online,priority,level")
    ap.add_argument("--easy-n", type=int, default=128, help="rows of the easy source")
    ap.add_argument("--mid-n", type=int, default=8000, help="rows of the learnable source")
    ap.add_argument("--hard-n", type=int, default=128, help="rows of the hard source")
    ap.add_argument("--retry-after", type=int, default=2000, help="online: draws before a dropped prompt returns")
    ap.add_argument("--threshold", type=float, default=0.8, help="level: rolling accuracy that moves on")
    ap.add_argument("--window", type=int, default=32, help="level: groups in the rolling accuracy")
    ap.add_argument("--sft-easy", type=float, default=0.9, help="SFT stops once 2-digit train accuracy is >= this")
    ap.add_argument("--sft-mid", type=float, default=0.2, help="... and 3-digit train accuracy is >= this")
    ap.add_argument("--sft-chunk", type=int, default=100, help="SFT steps between checks")
    ap.add_argument("--sft-max", type=int, default=3000, help="most SFT steps")
    args = ap.parse_args(argv)
    steps = args.steps or (20 if args.quick else 60)
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
        held = held_out_sets(spec)
        start, sft_steps, sft_s = warm_start(spec, tok, args)
        acc0 = held_out_accuracy(start, tok, held, spec.rollout.max_new_tokens)
        print(f"seed {seed}: warm start after {sft_steps} SFT steps ({sft_s:.0f}s): held-out "
              + ", ".join(f"{k} {v:.2f}" for k, v in acc0.items()), flush=True)
        for v in variants:
            r = run_variant(spec, curricula(args)[v], start, tok, held, args.eval_every)
            results[v].append(r)
            print(f"  {v:>9}: final {r['final']['all']:.3f} ("
                  + ", ".join(f"{k} {r['final'][k]:.2f}" for k in LEVELS)
                  + f"), useful tokens {r['useful_token_share']:.2f}, skipped {r['skipped']:.0f}, "
                  f"{r['wall_s']:.0f}s", flush=True)

    def ratio(v: str) -> float:
        """Mean over seeds of (steps to reach uniform's final accuracy) / steps; not reached counts as 1 + 1/steps
        (an optimistic bound: it would take more than the run)."""
        out = []
        for r, u in zip(results[v], results["uniform"], strict=True):
            hit = steps_to(r["curve"], u["final"]["all"])
            out.append(hit / steps if hit is not None else 1 + 1 / steps)
        return statistics.mean(out)

    summary = {v: {"accuracy": statistics.mean(r["final"]["all"] for r in results[v]),
                   "accuracy_sd": statistics.stdev([r["final"]["all"] for r in results[v]]) if seeds > 1 else 0.0,
                   "steps_ratio": ratio(v),
                   "useful_token_share": statistics.mean(r["useful_token_share"] for r in results[v]),
                   "mid_accuracy": statistics.mean(r["final"]["mid"] for r in results[v])} for v in variants}
    print(f"\n{steps} steps x {spec.rollout.prompts_per_step} prompts x {spec.algorithm.group_size} samples, "
          f"{seeds} seed(s), held-out: 100 problems per level")
    print(f"{'variant':>9} {'held-out acc':>14} {'mid acc':>8} {'steps to uniform final':>23} {'useful tokens':>14}")
    for v, m in summary.items():
        print(f"{v:>9} {m['accuracy']:9.3f} ±{m['accuracy_sd']:.3f} {m['mid_accuracy']:8.3f} "
              f"{m['steps_ratio']:22.2f}x {m['useful_token_share']:14.2f}")
    curricula_run = [v for v in variants if v != "uniform"]
    best = min(curricula_run, key=lambda v: (summary[v]["steps_ratio"], -summary[v]["accuracy"])) \
        if curricula_run else "uniform"
    out = {"accuracy_uniform": round(summary["uniform"]["accuracy"], 4),
           "accuracy_curriculum": round(summary[best]["accuracy"], 4), "best_curriculum": best,
           "steps_ratio_vs_uniform": round(summary[best]["steps_ratio"], 4),
           "useful_token_share_uniform": round(summary["uniform"]["useful_token_share"], 4),
           "useful_token_share_curriculum": round(summary[best]["useful_token_share"], 4),
           "seeds": seeds, "steps": steps,
           "variants": {v: {k: round(x, 4) for k, x in m.items()} for v, m in summary.items()}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
