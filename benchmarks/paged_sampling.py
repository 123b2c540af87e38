"""CPU time of one sampling step: today's continuous-engine sampler (`factory.core.rollout.engines.sampler`, a
generator per row, inverse CDF, `.tolist()`) vs the paged engine's on-device sampler
(`factory.core.rollout.engines.paged.sampling`, one counter-based uniform a row, inverse CDF) eager and, with
`--inductor`, compiled by inductor (its compile takes minutes on a small CPU; the compile time is printed apart).

Workload: `--rows` rows of float32 logits over `--vocab` tokens (default 64 x 49,152, SmolLM2's vocabulary), each
row at temperature 0.8, with no top-p (1.0) and with top-p 0.9; the two samplers run in alternation, `--repeats`
times each after one warm-up, on the same logits and threads. Both include moving the result to the host (today's
`.tolist()`; a `.tolist()` of the new one's tokens and logprobs), as a step must. Prints a table of medians, then
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from factory.core.rollout.base import SamplingParams  # noqa: E402
from factory.core.rollout.engines import sampler  # noqa: E402
from factory.core.rollout.engines.paged import sampling  # noqa: E402
from factory.core.rollout.engines.sequences import Sequence  # noqa: E402


def _ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--inductor", action="store_true", help="also time the sampler compiled by inductor")
    args = ap.parse_args()
    rows, device = args.rows, torch.device("cpu")
    logits = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    compiled = torch.compile(sampling.sample, fullgraph=True) if args.inductor else None
    result: dict = {"rows": rows, "vocab": args.vocab, "repeats": args.repeats, "threads": torch.get_num_threads()}
    print(f"{'top_p':>6} {'today ms':>10} {'new eager ms':>13} {'new inductor ms':>16}")
    for top_p in (1.0, 0.9):
        seqs = [Sequence([1], SamplingParams(temperature=0.8, top_p=top_p), Future(),
                         torch.Generator().manual_seed(i), 0.0) for i in range(rows)]
        old_knobs = sampler.knobs(seqs, device)
        knobs = sampling.knobs([0.8] * rows, [top_p] * rows, [0] * rows, [False] * rows, list(range(rows)),
                               [0] * rows)
        truncate = top_p < 1

        def new(fn=sampling.sample, knobs=knobs, truncate=truncate):
            out = fn(logits, knobs, truncate=truncate)
            return torch.stack([out.tokens.double(), out.logprobs.double()]).tolist()

        today = _ms(lambda seqs=seqs, k=old_knobs: sampler.sample(logits, seqs, k, device), args.repeats)
        eager = _ms(new, args.repeats)
        row = {"today_ms": round(today, 1), "eager_ms": round(eager, 1)}
        if compiled is not None:
            t = time.perf_counter()
            new(compiled)
            row["inductor_compile_s"] = round(time.perf_counter() - t, 1)
            row["inductor_ms"] = round(_ms(lambda k=knobs, tr=truncate: new(compiled, k, tr), args.repeats), 1)
        result[f"top_p_{top_p}"] = row
        print(f"{top_p:>6} {today:>10.1f} {eager:>13.1f} {row.get('inductor_ms', float('nan')):>16.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
