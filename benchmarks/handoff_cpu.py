"""CPU figures for issue 34's handoff: the in-process handoff before (a clone of the state, then `load_state_dict`,
which copies tied weights twice) and now (`load_state_dict_into`: one cast-copy per storage from the live tensors),
and the codec's encode with 1 worker thread vs `codec.WORKERS`. Prints one JSON line; medians and ranges of `--n`.

    PYTHONPATH=. python benchmarks/handoff_cpu.py --layers 4 --n 5

The model is the Qwen2-0.5B shape cut to `--layers` layers (the 151,936-token tied embedding kept), fp32, random.
On a GPU these copies are device copies; this measures the CPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from common import random_model  # noqa: E402

from factory.core.rollout.engines.sequences import load_state_dict_into  # noqa: E402
from factory.core.weights import codec, encode_delta, encode_full  # noqa: E402
from factory.core.weights.staging import HostStaging  # noqa: E402


def timed(fn, n: int) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0], "max_s": times[-1], "n": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--n", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    trainer = random_model("qwen2-0.5b", num_hidden_layers=a.layers)
    engine = random_model("qwen2-0.5b", seed=1, num_hidden_layers=a.layers)
    live = trainer.state_dict()
    out: dict = {"params": sum(p.numel() for p in trainer.parameters()), "layers": a.layers,
                 "threads": torch.get_num_threads()}

    def before() -> None:  # OverlappedProducer.publish + EngineControl._load as they were
        engine.load_state_dict({k: v.detach().clone() for k, v in live.items()}, strict=False)

    out["in_process_before"] = timed(before, a.n)
    out["in_process_now"] = timed(lambda: load_state_dict_into(engine, live), a.n)

    staging = HostStaging(torch.bfloat16)
    prev = staging.snapshot(live)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(1e-6 * torch.randn_like(p))
    new = staging.snapshot(trainer.state_dict(), keep=prev)
    out["bf16_mb"] = sum(v.numel() * 2 for k, v in new.items() if k != "lm_head.weight") / 1e6
    workers = codec.WORKERS
    for w in sorted({1, workers}):
        codec.WORKERS = w
        out[f"encode_full_workers_{w}"] = timed(lambda: encode_full(new, 2), a.n)
        out[f"encode_delta_workers_{w}"] = timed(lambda: encode_delta(prev, new, 2, 1), a.n)
    codec.WORKERS = workers
    print(json.dumps(out))


if __name__ == "__main__":
    main()
