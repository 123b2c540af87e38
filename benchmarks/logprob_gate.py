"""The step-0 log-prob gate (`factory/core/gate.py`) on the quickstart setup: what it costs, and the gap it sees with
the engine's weights as they are, rounded to fp16 and rounded to bf16 (the engine sampling from a rounded copy, the
trainer on the fp32 weights).

    .venv/bin/python benchmarks/logprob_gate.py                   # the quickstart's tiny model, fresh
    .venv/bin/python benchmarks/logprob_gate.py --checkpoint DIR  # e.g. its SFT checkpoint (checkpoints/sft-*)
    .venv/bin/python benchmarks/logprob_gate.py --spread          # weights drawn from N(0, 0.2) (the tests')
    .venv/bin/python benchmarks/logprob_gate.py --modes           # also one_step_off, in-process and rollout server

Per arm: the gate's seconds over --repeats calls (mean and 95% interval; the producer and trainer built once, as in
a run), and the figures of one call: mean and max |engine - trainer log-prob|, the k3 KL, the share of the gap the
largest 5% of tokens carry, and whether the default bound (`ops.logprob_gap_bound`) stops it. With --modes, the gate's
seconds through the producers of one_step_off (the in-process engine, then a rollout server process), the weights as
they are, their producer threads generating training groups meanwhile as in a run. The last line is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from factory.config import apply_overrides, load_spec
from factory.core.gate import check_engine
from factory.core.loop import make_producer
from factory.core.producers.sync import SyncProducer
from factory.core.rollout.engines.embedded import EmbeddedEngine
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.data.feed import make_feed
from factory.envs.tasks import make_task_splits
from factory.intervals import mean_interval
from factory.models.build import build_model
from factory.models.checkpoint import load_checkpoint
from factory.models.tokenizer import tokenizer_for

ROUNDINGS = {"as_is": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def rounded(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    if dtype is None:
        return model
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.to(dtype).float())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spec", default="examples/quickstart.yaml")
    p.add_argument("--checkpoint", help="a checkpoint directory to start from (default: the preset, fresh)")
    p.add_argument("--spread", action="store_true", help="weights drawn from N(0, 0.2), as tests/core/test_gate.py")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--modes", action="store_true", help="also time the gate through one_step_off's producers")
    a = p.parse_args()
    torch.set_num_threads(1)
    spec = load_spec(a.spec)
    if a.checkpoint:
        model, tok = load_checkpoint(a.checkpoint)
    else:
        tok = tokenizer_for(spec.task.name)
        model = build_model(spec.model.preset, tok, seed=spec.seed)
    if a.spread:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for w in model.parameters():
                if w.dim() > 1:
                    w.normal_(0, 0.2, generator=g)
    train = make_task_splits(spec.task, spec.seed).train
    prompts = [q.prompt for q in train]
    trainer = TorchTrainer(model, lr=0.0, temperature=spec.rollout.temperature)
    out = {"model": a.checkpoint or f"{spec.model.preset} (fresh{', spread' if a.spread else ''})",
           "repeats": a.repeats}
    for arm, dtype in ROUNDINGS.items():
        producer = SyncProducer(spec, model, tok, make_feed(spec.resolved.blend, train), 0)
        producer.engine = EmbeddedEngine(rounded(model, dtype), tok)  # what the engine samples from
        res, times = timed(spec, trainer, producer, tok, prompts, a.repeats)
        ci = mean_interval(times, bounded=False)  # seconds, not a share
        f = res.figures
        out[arm] = {"seconds_mean": sum(times) / len(times), "seconds_ci95": [ci.low, ci.high],
                    "gap_abs_mean": f["gap_abs_mean"], "gap_abs_max": f["gap_abs_max"], "gap_kl": f["gap_kl"],
                    "top_share": f["top_share"], "tokens": f["tokens"], "bound": res.bound, "stopped": not res.passed,
                    "causes": res.cause}
        print(f"{arm:6s} gate {out[arm]['seconds_mean'] * 1e3:.1f} ms [{ci.low * 1e3:.1f}, {ci.high * 1e3:.1f}] "
              f"n={a.repeats}; gap mean {f['gap_abs_mean']:.3g} max {f['gap_abs_max']:.3g} k3 {f['gap_kl']:.3g} "
              f"top5% {f['top_share']:.2f} over {f['tokens']} tokens; bound {res.bound:g}: "
              f"{'STOPPED (' + res.cause + ')' if not res.passed else 'passes'}", flush=True)
    for engine in ("embedded", "server") if a.modes else ():
        s = apply_overrides(spec, {"schedule.mode": "one_step_off", "rollout.engine": engine})
        res, times = timed(s, trainer, make_producer(s, model, tok, train, 0), tok, prompts, a.repeats)
        ci = mean_interval(times, bounded=False)  # seconds, not a share
        out[f"one_step_off_{engine}"] = {"producer": res.engine, "seconds_mean": sum(times) / len(times),
                                         "seconds_ci95": [ci.low, ci.high], "gap_abs_mean": res.figures["gap_abs_mean"]}
        print(f"one_step_off {engine} ({res.engine}): gate {sum(times) / len(times) * 1e3:.1f} ms [{ci.low * 1e3:.1f}, "
              f"{ci.high * 1e3:.1f}] n={a.repeats}; gap mean {res.figures['gap_abs_mean']:.3g}", flush=True)
    print(json.dumps(out))
    return 0


def timed(spec, trainer, producer, tok, prompts: list[str], repeats: int):
    """One gate's result, and the seconds of `repeats` more; the producer is closed after."""
    try:
        res = check_engine(spec, trainer, producer, tok, prompts)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            check_engine(spec, trainer, producer, tok, prompts)
            times.append(time.perf_counter() - t0)
    finally:
        producer.close()
    return res, times


if __name__ == "__main__":
    sys.exit(main())
