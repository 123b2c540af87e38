"""Weight sync: bytes and time of a full update vs a lossless delta, per published version.

Two workloads:

- tiny: the `tiny` preset (~0.8M params) trained by real RL-style steps: for each version, G=8
  completions sampled from the model for each of P=8 arithmetic prompts, a verifiable reward (the
  share of digit tokens in the completion), group-normalized advantages, the policy-gradient loss
  -A * mean log p, and two AdamW minibatch steps (betas 0.9/0.99, grad clip 1.0), as the
  quickstart's GRPO trainer does. Run at lr 3e-4 (the quickstart) and 1e-6 (RL on real LLMs).
  Each version is published as fp32 (the trainer's dtype) and as bf16 (what an inference engine
  serves); the delta is against the previous version.
- 1b: a synthetic bf16 set shaped like TinyLlama-1.1B (22 layers, hidden 2048, MLP 5632, GQA k/v
  256, vocab 32000, untied head; `--quick`: ~110M params). fp32 master weights ~N(0, 0.02) (norms:
  1.0) take an Adam-like step per element, lr * u, and are cast to bf16 for publication, so most
  bf16 values do not move. u is resampled from the per-element Adam steps (delta theta / lr) that
  the tiny model's real run at lr 1e-6 took (`--update tiny`, default), or u = +-1 (`--update
  sign`: the first Adam step, the largest per-element steps Adam makes; a worst case).

Full bytes: the serialized full update (raw tensor bytes + header); delta bytes: the serialized delta. encode/apply are
wall seconds for the whole state (apply includes the sha256 check of every tensor). bit_exact
compares raw bytes of every tensor after apply. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from factory.core.weights import TensorPayload, WeightUpdate, apply_update, encode_delta  # noqa: E402
from factory.models.build import build_model  # noqa: E402
from factory.models.tokenizer import build_tokenizer  # noqa: E402


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if list(a) != list(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def unchanged_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    same = sum(int((a[k].view(ints[a[k].element_size()]) == b[k].view(ints[b[k].element_size()])).sum()) for k in a)
    return same / sum(v.numel() for v in a.values())


def full_nbytes(state: dict[str, torch.Tensor], version: int) -> int:
    """Serialized size of the full update, without copying the weights (raw payload = the tensor bytes)."""
    tensors = [TensorPayload(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), "raw", "0" * 64,
                             memoryview(v.reshape(-1).view(torch.uint8).numpy())) for k, v in state.items()]
    return WeightUpdate(version, None, "full", tensors).nbytes


def order0_bound(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], full_bytes: int) -> float:
    """The best ratio any order-0 entropy coder of this delta could reach: full bytes over (entropy of the gaps
    between changed elements + entropy of their zigzag differences) x changed count, pooled over tensors.
    What a lossless delta must at least send, short of modelling context between positions."""
    import numpy as np

    from factory.core.weights.codec import _flat_bits, _zigzag

    gaps, vals = [], []
    for k in new:
        p, q = _flat_bits(prev[k]), _flat_bits(new[k])
        idx = np.flatnonzero(p != q)
        if len(idx):
            gaps.append(np.diff(idx, prepend=-1))
            vals.append(_zigzag(q[idx] - p[idx]).astype(np.uint64))
    if not gaps:
        return float("inf")

    def bits(x: np.ndarray) -> float:
        _, counts = np.unique(x, return_counts=True)
        pr = counts / counts.sum()
        return float(-(pr * np.log2(pr)).sum() * counts.sum())

    g, v = np.concatenate(gaps), np.concatenate(vals)
    return full_bytes / ((bits(g) + bits(v)) / 8)


def measure(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int,
            with_bound: bool = False) -> dict:
    """One version: the delta against the previous one, encoded, serialized, parsed and applied in place
    (as a subscriber does; `prev` becomes the new version), checked bit-exact against `new`."""
    unchanged = unchanged_fraction(prev, new)
    full_bytes = full_nbytes(new, version)
    bound = order0_bound(prev, new, full_bytes) if with_bound else None  # tiny only: a pass over every element
    t0 = time.perf_counter()
    delta = encode_delta(prev, new, version, version - 1)
    encode_s = time.perf_counter() - t0
    blob = delta.to_bytes()
    t0 = time.perf_counter()
    out = apply_update(prev, WeightUpdate.from_bytes(blob), version - 1, inplace=True)
    apply_s = time.perf_counter() - t0
    return dict(full_bytes=full_bytes, delta_bytes=len(blob), ratio=full_bytes / len(blob), bound=bound,
                encode_s=encode_s,
                apply_s=apply_s, bit_exact=bits_equal(out, new), unchanged=unchanged,
                schemes={s: sum(t.scheme == s for t in delta.tensors) for s in ("same", "sparse", "dense", "raw")})


# ---------------------------------------------------------------------------------------------
# tiny model, real RL-style updates


def rl_versions(lr: float, n_versions: int, seed: int = 0) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """fp32 states of versions 0..n (named parameters; tied weights once) and, per version, the
    per-element Adam step in units of lr (delta theta / (lr * optimizer steps))."""
    tok = build_tokenizer()
    model = build_model("tiny", tok, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    digits = {tok.convert_tokens_to_ids(c) for c in "0123456789"}
    is_digit = torch.zeros(len(tok), dtype=torch.bool)
    is_digit[list(digits)] = True
    P, G, T, minibatches = 8, 8, 8, 2

    def snapshot() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    states, steps = [snapshot()], []
    for _ in range(n_versions):
        prompts = [f"{rng.randint(100, 999)}+{rng.randint(100, 999)}=" for _ in range(P)]
        ids = torch.tensor([tok(p).input_ids for p in prompts for _ in range(G)])
        model.eval()
        with torch.no_grad():  # sample completions from the current policy
            seq = ids
            for _ in range(T):
                logits = model(input_ids=seq).logits[:, -1, :].float()
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
                seq = torch.cat([seq, nxt], 1)
        completion = seq[:, ids.shape[1]:]
        reward = is_digit[completion].float().mean(-1).view(P, G)
        adv = ((reward - reward.mean(-1, keepdim=True)) / (reward.std(-1, keepdim=True) + 1e-6)).view(-1)
        model.train()
        for chunk in torch.randperm(P * G, generator=gen).chunk(minibatches):
            logp = torch.log_softmax(model(input_ids=seq[chunk]).logits[:, ids.shape[1] - 1 : -1].float(), -1)
            tok_logp = logp.gather(-1, completion[chunk].unsqueeze(-1)).squeeze(-1)
            loss = -(adv[chunk] * tok_logp.mean(-1)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        states.append(snapshot())
        steps.append(torch.cat([(states[-1][k] - states[-2][k]).reshape(-1) for k in states[-1]]) / (lr * minibatches))
    return states, steps


def bench_tiny(n_versions: int) -> tuple[list[dict], torch.Tensor]:
    rows, calib = [], None
    for lr in (3e-4, 1e-6):
        states, steps = rl_versions(lr, n_versions)
        if lr == 1e-6:
            calib = torch.cat(steps[1:] if len(steps) > 1 else steps)  # past Adam's first (sign) step
        for dtype in (torch.float32, torch.bfloat16):
            cast = [{k: v.to(dtype) for k, v in s.items()} for s in states]
            per = [measure({k: t.clone() for k, t in cast[v - 1].items()}, cast[v], v, with_bound=True)
                   for v in range(1, n_versions + 1)]
            rows.append(dict(workload="tiny", lr=lr, dtype=str(dtype).removeprefix("torch."), per_version=per))
    return rows, calib


# ---------------------------------------------------------------------------------------------
# synthetic 1B bf16


def shapes_1b(quick: bool) -> dict[str, tuple[int, ...]]:
    layers, hidden, mlp, kv, vocab = (12, 768, 2048, 768, 32000) if quick else (22, 2048, 5632, 256, 32000)
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm": (hidden,), p + "q_proj": (hidden, hidden), p + "k_proj": (kv, hidden),
                   p + "v_proj": (kv, hidden), p + "o_proj": (hidden, hidden),
                   p + "post_attention_layernorm": (hidden,), p + "gate_proj": (mlp, hidden),
                   p + "up_proj": (mlp, hidden), p + "down_proj": (hidden, mlp)}
    return shapes | {"norm": (hidden,), "lm_head": (vocab, hidden)}


def adam_step_(master: dict[str, torch.Tensor], lr: float, update: str, pool: torch.Tensor | None,
               gen: torch.Generator) -> None:
    """master += lr * u per element, in place, in blocks (bounded temporaries)."""
    block = 1 << 24
    for t in master.values():
        flat = t.view(-1)
        for s in range(0, flat.numel(), block):
            part = flat[s : s + block]
            if update == "sign":
                u = torch.randint(0, 2, part.shape, generator=gen, dtype=torch.int8).float().mul_(2).sub_(1)
            else:
                u = pool[torch.randint(0, pool.numel(), part.shape, generator=gen)]
            part.add_(u, alpha=lr)


def bench_1b(quick: bool, n_versions: int, lr: float, update: str, pool: torch.Tensor | None) -> dict:
    gen = torch.Generator().manual_seed(0)
    shapes = shapes_1b(quick)
    t0 = time.perf_counter()
    master = {k: (torch.ones(s) if len(s) == 1 else torch.empty(s).normal_(0, 0.02, generator=gen))
              for k, s in shapes.items()}
    n_params = sum(v.numel() for v in master.values())
    prev = {k: v.bfloat16() for k, v in master.items()}
    setup_s = time.perf_counter() - t0
    per = []
    for v in range(1, n_versions + 1):
        adam_step_(master, lr, update, pool, gen)
        new = {k: t.bfloat16() for k, t in master.items()}
        per.append(measure(prev, new, v))
        prev = new
    return dict(workload="1b", lr=lr, dtype="bfloat16", update=update, n_params=n_params, setup_s=setup_s,
                per_version=per)


def median(row: dict, key: str) -> float:
    return statistics.median(p[key] for p in row["per_version"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~110M-param synthetic set, fewer versions")
    ap.add_argument("--versions", type=int, default=None, help="versions per workload (default 6; quick 3)")
    ap.add_argument("--update", choices=["tiny", "sign", "both"], default="both",
                    help="1b per-element step model (default: both; the JSON headline uses 'tiny')")
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    n = args.versions or (3 if args.quick else 6)
    t_start = time.perf_counter()

    tiny_rows, pool = bench_tiny(n)
    big_rows = []
    for update in (["tiny", "sign"] if args.update == "both" else [args.update]):
        big_rows.append(bench_1b(args.quick, max(2, n // 2), args.lr, update, pool))

    header = (f"{'workload':9s} {'lr':>7s} {'dtype':9s} {'update':6s} {'unchanged':>9s} {'full MB':>9s} "
              f"{'delta MB':>9s} {'ratio':>8s} {'encode s':>9s} {'apply s':>8s} exact")
    print(header)
    print("-" * len(header))
    for row in tiny_rows + big_rows:
        print(f"{row['workload']:9s} {row['lr']:7.0e} {row['dtype']:9s} {row.get('update', 'real'):6s} "
              f"{median(row, 'unchanged'):9.2%} {median(row, 'full_bytes') / 1e6:9.2f} "
              f"{median(row, 'delta_bytes') / 1e6:9.3f} {median(row, 'ratio'):8.1f} "
              f"{median(row, 'encode_s'):9.3f} {median(row, 'apply_s'):8.3f} "
              f"{all(p['bit_exact'] for p in row['per_version'])}")
    print("(medians over versions; ratio = full bytes / delta bytes)")
    for row in tiny_rows:
        print(f"  tiny lr {row['lr']:.0e} {row['dtype']}: ratio per version "
              + " ".join(f"{p['ratio']:.1f}" for p in row["per_version"])
              + "  (order-0 entropy bound " + " ".join(f"{p['bound']:.1f}" for p in row["per_version"]) + ")")
    if pool is not None:
        q = torch.quantile(pool.abs()[:1_000_000], torch.tensor([0.1, 0.5, 0.9])).tolist()
        print(f"  tiny lr 1e-06 Adam |step|/lr quantiles 10/50/90%: {q[0]:.3f} {q[1]:.3f} {q[2]:.3f}")

    def pick(rows: list[dict], **kw) -> dict:
        return next(r for r in rows if all(r.get(k) == v for k, v in kw.items()))

    tiny_head = pick(tiny_rows, lr=1e-6, dtype="bfloat16")
    big_head = big_rows[0]
    figures = {
        "delta_ratio_tiny": round(median(tiny_head, "ratio"), 1),
        # no order-0 coder of this update's positions and values can beat this ratio
        "delta_bound_tiny": round(median(tiny_head, "bound"), 1),
        "delta_ratio_1b": round(median(big_head, "ratio"), 1),
        "bit_exact": all(p["bit_exact"] for r in tiny_rows + big_rows for p in r["per_version"]),
        "encode_s_1b": round(median(big_head, "encode_s"), 3),
        "apply_s_1b": round(median(big_head, "apply_s"), 3),
        "params_1b": big_head["n_params"],
        "update_1b": big_head["update"],
        "unchanged_1b": round(median(big_head, "unchanged"), 4),
        "full_mb_1b": round(median(big_head, "full_bytes") / 1e6, 1),
        "delta_mb_1b": round(median(big_head, "delta_bytes") / 1e6, 2),
        "delta_ratio_tiny_lr3e-4_bf16": round(median(pick(tiny_rows, lr=3e-4, dtype="bfloat16"), "ratio"), 2),
        "delta_ratio_tiny_lr3e-4_fp32": round(median(pick(tiny_rows, lr=3e-4, dtype="float32"), "ratio"), 2),
        "delta_ratio_tiny_lr1e-6_fp32": round(median(pick(tiny_rows, lr=1e-6, dtype="float32"), "ratio"), 2),
        "quick": args.quick,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    for r in big_rows[1:]:
        figures[f"delta_ratio_1b_{r['update']}"] = round(median(r, "ratio"), 1)
        figures[f"encode_s_1b_{r['update']}"] = round(median(r, "encode_s"), 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
