"""A short GRPO run of the BPE model with rollouts from SGLang (async schedule): does held-out accuracy rise?

The experiment is `examples/bring_your_own_model.yaml` (2-digit addition, reversed answers, ChatML prompts) on a
fresh `build_bpe_model_dir` model (a ~0.9M-parameter Qwen2 with a byte-level BPE tokenizer, random init, no
download), warm-started by its SFT stage (`train_sft_checkpoint`, stopping at 0.3 held-out accuracy), then trained
by GRPO (`factory.core.loop.train_rl`) with `rollout.engine: sglang` and `schedule.mode: async`: the producer
threads sample from SGLang servers that Factory starts from `--sglang-python` on a checkpoint of the SFT model,
and every trainer step's weights reach them through `rollout.sglang.weight_update` (default tensor). Held-out
greedy accuracy (the embedded engine, `evaluate`) is printed before and after, with the per-step reward.

On one H100 (sglang in its own venv; Factory's venv runs the trainer, on CPU: the model is tiny):

    python benchmarks/gpu/grpo_sglang.py --sglang-python /opt/sglang-venv/bin/python

The servers get `--attention-backend triton` by default (`--sglang-arg` replaces the defaults): the model's
head_dim is 32, which not every SGLang attention backend supports; `torch_native` is the fallback to try
(`--sglang-arg=--attention-backend --sglang-arg=torch_native`: arguments starting with `--` need the `=`).

`--smoke`: the fake SGLang server (tests/core/fake_sglang_server.py: deterministic tokens, not the model), 2 GRPO
steps after a short SFT, CPU: the code path ran (servers started, weights published every step, async
producers, versions checked); the accuracies and rewards mean nothing, and do not rise.

What was NOT run in this repository's sessions: any real SGLang server, any GPU (none was lent); only --smoke.
So whether reward rises under SGLang sampling is not known here.

Prints the per-step rewards, a summary, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, sglang_python, sglang_spec, smoke_note  # noqa: E402

from factory.config import apply_overrides, load_spec, parse_overrides  # noqa: E402
from factory.core.evaluate import evaluate  # noqa: E402
from factory.core.loop import train_rl  # noqa: E402
from factory.core.rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from factory.home import factory_home  # noqa: E402
from factory.models.bpe import build_bpe_model_dir  # noqa: E402
from factory.models.checkpoint import load_checkpoint  # noqa: E402
from factory.runs.stages import build_dataset, load_dataset, train_sft_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="fake SGLang server, short SFT, 2 GRPO steps, CPU")
    ap.add_argument("--sglang-python", default=None, help="python of sglang's venv (default: $SGLANG_PYTHON)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO steps (default 40; smoke 2)")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--weight-update", choices=("disk", "tensor", "distributed"), default="tensor")
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--sglang-arg", action="append", default=None,
                    help="sglang.launch_server arguments (default: --attention-backend triton)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                    help="more spec overrides, e.g. algorithm.lr=1e-3 (repeatable)")
    a = ap.parse_args(argv)
    steps = a.steps or (2 if a.smoke else 40)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    home = Path(tempfile.mkdtemp(prefix="gpu-grpo-sglang-"))
    paths = factory_home(home)
    model_dir = build_bpe_model_dir(home / "bpe-tiny", seed=0)
    sg = sglang_spec(smoke=a.smoke, workdir=home, servers=a.servers, weight_update=a.weight_update,
                     python=sglang_python(a.sglang_python), mem_fraction=a.mem_fraction, fake_vocab=512,
                     extra_args=["--attention-backend", "triton"] if a.sglang_arg is None else a.sglang_arg)
    overrides = {"model.path": str(model_dir), "name": "grpo-sglang-bench", "schedule.mode": "async",
                 "schedule.steps": steps, "schedule.eval_every": 0, "rollout.engine": "sglang",
                 "rollout.sglang": sg.model_dump(mode="json"), "schedule.wait_timeout_s": 900,
                 "rollout.devices": list(range(a.servers)) if torch.cuda.is_available() and not a.smoke else None}
    if a.smoke:
        overrides |= {"sft.steps": 10, "sft.check_every": 5, "task.n_train": 64, "task.n_eval": 16,
                      "rollout.prompts_per_step": 4, "algorithm.group_size": 4}
    spec = apply_overrides(load_spec(ROOT / "examples" / "bring_your_own_model.yaml"),
                           {**overrides, **parse_overrides(a.overrides)})
    splits = load_dataset(build_dataset(spec, paths).path)
    t0 = time.perf_counter()
    sft = train_sft_checkpoint(spec, paths, splits, log=lambda _: None)
    print(f"SFT warm start: {sft.steps} steps, held-out accuracy {sft.accuracy:.3f} ({time.perf_counter() - t0:.0f}s)",
          flush=True)
    model, tok = load_checkpoint(sft.checkpoint.path)
    n_new = spec.rollout.max_new_tokens
    before = evaluate(EmbeddedEngine(model, tok), tok, splits.eval, n_new).accuracy
    t0 = time.perf_counter()
    records = train_rl(spec, model, tok, splits.train,
                         on_step=lambda r: print(f"  step {r.step:3d}: reward {r.reward_mean:.3f}  sampled accuracy "
                                                 f"{r.accuracy:.3f}  staleness max {r.staleness_max:.0f}", flush=True))
    grpo_s = time.perf_counter() - t0
    after = evaluate(EmbeddedEngine(model, tok), tok, splits.eval, n_new).accuracy
    k = max(1, min(5, len(records) // 2))
    first = statistics.mean(r.reward_mean for r in records[:k])
    last = statistics.mean(r.reward_mean for r in records[-k:])
    note = smoke_note(a.smoke)
    print()
    if note:
        print(note)
    print(f"held-out accuracy: {before:.3f} before GRPO -> {after:.3f} after {len(records)} steps "
          f"(rollout.engine sglang, async, weight_update {a.weight_update}, {a.servers} server(s))")
    print(f"reward: mean of the first {k} steps {first:.3f}, of the last {k} {last:.3f}; GRPO wall {grpo_s:.0f}s")
    print(json.dumps({
        "accuracy_before": round(before, 4), "accuracy_after": round(after, 4), "accuracy_sft": round(sft.accuracy, 4),
        "reward_first": round(first, 4), "reward_last": round(last, 4), "reward_rose": last > first,
        "accuracy_rose": after > before, "steps": len(records), "rewards": [round(r.reward_mean, 4) for r in records],
        "staleness_max": max(r.staleness_max for r in records), "grpo_wall_s": round(grpo_s, 1),
        "wall_s": round(time.perf_counter() - t_start, 1), "weight_update": a.weight_update, "servers": a.servers,
        "smoke": a.smoke, "note": note,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
