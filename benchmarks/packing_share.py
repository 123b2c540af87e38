"""Padding in RL-shaped micro-batches: the share of token slots that hold no real token, right-padded (today's
`batch.pack` layout) and packed (`factory/core/trainer/packing.py`), and the attention score work of each layout
relative to the padded one. A count, not a timing: it runs on any CPU in seconds.

Rows are drawn as nano-vllm's benchmark draws its requests: prompt and output lengths each uniform in [100, 1024]
tokens, independent per row. For each micro-batch size B, `--batches` batches (seeded) are laid out by the same
`plan_packing` the trainer calls:
- padded: B x (longest row) slots;
- packed, one row (flash-attention varlen, flex): the total rounded up to `--bucket`;
- packed, rows capped at the padded width (a dense document mask), first-fit-decreasing;
- packed as the trainer lays out the Qwen2-0.5B shape under sdpa (`choose_row_cap` with that model's `pair_cost`,
  the model built on the meta device: nothing allocated).
Attention work counts the (query, key) pairs a kernel computes: a dense mask computes every pair of a row (rows x
length^2), a varlen kernel only each sample's own (the sum of length^2); causal halving is left out of every one
alike. "work 0.5B": the trainer's layout's matmul tokens plus attention pairs at that model's `pair_cost`, over the
padded batch's (the estimate `choose_row_cap` minimizes, not a timing). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from factory.core.trainer.packing import choose_row_cap, pair_cost, plan_packing, round_up


def qwen2_05b_pair_cost() -> float:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.gpu.common import SHAPES

    with torch.device("meta"):
        return pair_cost(Qwen2ForCausalLM(Qwen2Config(**SHAPES["qwen2-0.5b"])))


def measure(b: int, batches: int, bucket: int, seed: int, cost: float) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    pad, one, capped, chosen, att_dense_one, att_capped, att_chosen, att_varlen = [], [], [], [], [], [], [], []
    work = []  # the trainer's layout against padded: tokens + cost x pairs (the model's estimate, not a timing)
    for _ in range(batches):
        lengths = (torch.randint(100, 1025, (b,), generator=g) + torch.randint(100, 1025, (b,), generator=g)).tolist()
        width, real = max(lengths), sum(lengths)
        one_row = plan_packing(lengths, width, bucket)
        rows = plan_packing(lengths, width, bucket, round_up(width, bucket))
        trainer = plan_packing(lengths, width, bucket, choose_row_cap(lengths, width, bucket, cost))
        chosen.append(1 - real / trainer.packed_tokens)
        pad.append(1 - real / (b * width))
        one.append(1 - real / one_row.packed_tokens)
        capped.append(1 - real / rows.packed_tokens)
        dense_padded = b * width ** 2
        att_dense_one.append(one_row.length ** 2 / dense_padded)
        att_capped.append(rows.rows * rows.length ** 2 / dense_padded)
        att_chosen.append(trainer.rows * trainer.length ** 2 / dense_padded)
        work.append((trainer.packed_tokens + cost * trainer.rows * trainer.length ** 2)
                    / (b * width + cost * dense_padded))
        att_varlen.append(sum(n * n for n in lengths) / dense_padded)

    def summary(xs: list[float]) -> dict[str, float]:
        q = statistics.quantiles(xs, n=40) if len(xs) > 1 else [xs[0]] * 39
        return {"mean": statistics.fmean(xs), "p2.5": q[0], "p97.5": q[-1]}

    return {"B": b, "padded_share": summary(pad), "packed_one_row_share": summary(one),
            "packed_capped_share": summary(capped), "packed_trainer_05b_share": summary(chosen),
            "attention_one_row_dense": summary(att_dense_one), "attention_capped_dense": summary(att_capped),
            "attention_trainer_05b": summary(att_chosen), "attention_varlen": summary(att_varlen),
            "work_trainer_05b": summary(work)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64, 256], help="micro-batch rows")
    ap.add_argument("--batches", type=int, default=200, help="batches drawn per size")
    ap.add_argument("--bucket", type=int, default=128, help="packed row length multiple")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cost = qwen2_05b_pair_cost()
    results = [measure(b, args.batches, args.bucket, args.seed, cost) for b in args.sizes]
    print(f"padding share of the token slots, mean [2.5%, 97.5%] over {args.batches} batches; attention pairs "
          f"relative to padded (means); pair_cost(qwen2-0.5b) = {cost:.3g}")
    print(f"{'B':>4} {'padded':>19} {'packed 1 row':>19} {'packed capped':>19} {'trainer, 0.5B':>19} | "
          f"{'1 row':>6} {'capped':>6} {'0.5B':>6} {'varlen':>6} | work 0.5B")
    for r in results:
        def share(k: str, r: dict = r) -> str:
            s = r[k]
            return f"{s['mean']:.3f} [{s['p2.5']:.3f},{s['p97.5']:.3f}]"

        att = " ".join(f"{r[k]['mean']:>6.2f}" for k in ("attention_one_row_dense", "attention_capped_dense",
                                                          "attention_trainer_05b", "attention_varlen"))
        print(f"{r['B']:>4} {share('padded_share'):>19} {share('packed_one_row_share'):>19} "
              f"{share('packed_capped_share'):>19} {share('packed_trainer_05b_share'):>19} | {att} | "
              f"{share('work_trainer_05b')}")
    print(json.dumps({"bench": "packing_share", "batches": args.batches, "bucket": args.bucket, "seed": args.seed,
                      "pair_cost_qwen2_05b": cost, "results": results}))


if __name__ == "__main__":
    main()
