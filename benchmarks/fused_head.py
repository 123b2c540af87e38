"""The vocabulary head of one training step, alone: hidden states [N + 1, H] in, target log-probs and the entropy
out, a per-token weighted loss, backward. Variants:

- `full`: the computation before chunking (the whole [N, V] logits, their float32 log-softmax and the entropy's graph
  kept through backward; `logprob_memory.old_token_logprobs`' head);
- `chunked`: today's `logprobs.chunked_logprobs`, each chunk under `torch.utils.checkpoint` (one chunk: not);
- `fused`: `trainer/fused_head.py`, logits recomputed in backward; `fused+keep`: its logits kept (the model's dtype).

`--mode memory` (default): computed, not run, for a shape (default Qwen2-0.5B: vocabulary 151,936, hidden 896) at
`--tokens` (default 16,384) on fake tensors (`FakeTensorMode`: shapes and dtypes, no data or memory): torch's
`MemTracker` counts the bytes alive once the forward returns, beyond its inputs (what the step holds for
backward), and the peak above the inputs over forward and backward (gradients included); `MatmulFlops` counts
the matmul FLOPs. In float32 and in bf16 autocast over float32 weights (`trainer.precision: bf16`; CPU autocast
stands in for CUDA's, which casts `linear` the same way); the fused weight gradient is summed in float32 as on
CUDA (addmm's `out_dtype`).

`--mode time`: measured: on the CPU in float32 at fewer tokens (default 256, 4 chunks); on CUDA (`--device cuda`,
the default where there is one; not yet run) in bf16 autocast, the fused variants under
`torch.cuda.set_sync_debug_mode("error")`, with each variant's peak memory. `--repeats` rounds, the variants in
turn within each round, each variant's median seconds and a 95% t-interval of its mean, its speed-up over `chunked`
paired by round (a 95% t-interval of the mean ratio), and the largest absolute difference of its values (log-probs,
entropy, gradients) from `chunked`. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.nn import functional as F  # noqa: E402, N812
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from factory.core.trainer import fused_head  # noqa: E402
from factory.core.trainer.fused_head import fused_logprobs  # noqa: E402
from factory.core.trainer.logprobs import chunked_logprobs  # noqa: E402

VARIANTS = ("full", "chunked", "fused", "fused+keep")
MIB = 1 << 20
aten = torch.ops.aten
# Two-sided 95% Student t quantiles by degrees of freedom (n - 1); beyond the table, the normal's 1.96.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       15: 2.131, 20: 2.086, 30: 2.042}

Head = Callable[[Tensor, Tensor, Tensor, float, int], tuple[Tensor, Tensor]]


def full(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, rows: int) -> tuple[Tensor, Tensor]:
    logits = F.linear(hidden, weight)[:-1]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def chunked(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, rows: int) -> tuple[Tensor, Tensor]:
    vocab = weight.shape[0]
    logp, entropy = chunked_logprobs(hidden[None], targets[None], lambda x: F.linear(x, weight), temperature, True,
                                     rows * vocab, vocab, drop_last=True)
    return logp[0], entropy[0]


def fused(keep: bool) -> Head:
    def head(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, rows: int) -> tuple[Tensor, Tensor]:
        return fused_logprobs(hidden[:-1], weight, None, targets, temperature, rows, keep)
    return head


HEADS: dict[str, Head] = {"full": full, "chunked": chunked, "fused": fused(False), "fused+keep": fused(True)}


def account(variant: str, tokens: int, hidden_size: int, vocab: int, rows: int, bf16: bool) -> dict:
    """One step of `variant` on fake tensors: MiB held for backward, peak MiB, head matmul GFLOP."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    # As on CUDA: the weight gradient summed into float32 by addmm's out_dtype (no CPU kernel; fake tensors run
    # its meta one), not through a [V, H] temporary per chunk.
    with FakeTensorMode(), _patched(fused_head, "_OUT_DTYPE_DEVICES", frozenset({"cuda", "cpu"})):
        weight = torch.empty(vocab, hidden_size, requires_grad=True)  # float32 master weight
        hidden = torch.empty(tokens + 1, hidden_size, requires_grad=True)  # the decoder's output (float32 under
        targets = torch.zeros(tokens, dtype=torch.long)                    # autocast too: Qwen2's final norm)
        loss_weights = torch.empty(tokens)
        tracker = MemTracker()
        tracker.track_external(weight, hidden, targets, loss_weights)
        flops = MatmulFlops()
        with tracker, flops:
            base = _total(tracker, "current")
            with amp:
                logp, entropy = HEADS[variant](hidden, weight, targets, 1.0, rows)
            held = _total(tracker, "current") - base
            (loss_weights * logp).sum().backward()
            peak = _total(tracker, "peak") - base
    return {"held_bytes": held, "peak_bytes": peak, "held_mib": round(held / MIB, 1), "peak_mib": round(peak / MIB, 1),
            "matmul_gflop": round(flops.total / 1e9, 1), "matmul_flops": flops.total}


class MatmulFlops(TorchDispatchMode):
    """2 x m x k x n per matrix product (mm, addmm, any overload: torch's FlopCounterMode misreads addmm's
    `out_dtype` one), as dispatched: `linear` and autograd's matmuls arrive as these."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        packet = func.overloadpacket
        if packet in (aten.mm, aten.addmm, aten.addmm_):
            a, b = args[:2] if packet is aten.mm else args[1:3]
            self.total += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _patched(obj: object, name: str, value: object):  # noqa: ANN202
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _total(tracker, kind: str) -> int:  # noqa: ANN001
    return sum(per["Total"] for per in tracker.get_tracker_snapshot(kind).values())


def timed(tokens: int, hidden_size: int, vocab: int, rows: int, repeats: int, device: torch.device,
          seed: int = 0) -> dict[str, dict]:
    """Forward + backward seconds of every variant, `repeats` interleaved rounds after a warm-up round: float32 on
    the CPU; on CUDA bf16 autocast over float32 weights, with the fused variants under
    `torch.cuda.set_sync_debug_mode("error")` (a host sync inside them raises) and each variant's peak memory."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden_size, generator=g) * hidden_size ** -0.5).to(device).requires_grad_()
    hidden = torch.randn(tokens + 1, hidden_size, generator=g).to(device).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    loss_weights = torch.randn(tokens, generator=g).to(device)
    cuda = device.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks: dict[str, int] = {}
    values: dict[str, tuple[Tensor, ...]] = {}
    for round_ in range(repeats + 1):  # round 0 warms up (first calls load code, size allocator pools): not counted
        for variant, head in HEADS.items():
            weight.grad = hidden.grad = None
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            with _sync_debug(cuda and variant.startswith("fused")):
                with amp:
                    logp, entropy = head(hidden, weight, targets, 0.7, rows)
                (loss_weights * logp).sum().backward()
            if cuda:
                torch.cuda.synchronize(device)
                peaks[variant] = torch.cuda.max_memory_allocated(device) - base
            if round_:
                seconds[variant].append(time.perf_counter() - t0)
            values[variant] = (logp.detach(), entropy.detach(), hidden.grad, weight.grad)
    out = {}
    for variant, s in seconds.items():
        diff = max(float((a - b).abs().max()) for a, b in zip(values[variant], values["chunked"], strict=True))
        mean, lo, hi = _mean_ci(s)
        # Paired by round (the same load for both): how many times faster than `chunked`.
        speedup = _mean_ci([c / x for c, x in zip(seconds["chunked"], s, strict=True)])
        out[variant] = {"median_s": round(statistics.median(s), 4), "mean_s": round(mean, 4),
                        "ci95_s": [round(lo, 4), round(hi, 4)], "n": len(s),
                        "speedup_vs_chunked": round(speedup[0], 3),
                        "speedup_ci95": [round(speedup[1], 3), round(speedup[2], 3)],
                        "max_abs_diff_vs_chunked": diff}
        if variant in peaks:
            out[variant]["peak_mib"] = round(peaks[variant] / MIB, 1)
    return out


def _mean_ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean and its two-sided 95% Student t interval."""
    mean = statistics.fmean(xs)
    half = T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0
    return mean, mean - half, mean + half


@contextlib.contextmanager
def _sync_debug(on: bool):  # noqa: ANN202
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="memory", choices=("memory", "time"))
    p.add_argument("--smoke", action="store_true", help="a 64-token vocabulary: seconds")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per step (default: 16384; 256 for --mode time on the CPU)")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk-rows", type=int, default=None, help="tokens per chunk (default: the trainer's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="for --mode time")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.vocab, args.tokens, args.repeats = 16, 64, args.tokens or 40, min(args.repeats, 2)
        args.chunk_rows = args.chunk_rows or 10
    tokens = args.tokens or (256 if args.mode == "time" and args.device == "cpu" else 16384)
    from factory.core.trainer.logprobs import CHUNK_ELEMENTS

    rows = args.chunk_rows or max(1, CHUNK_ELEMENTS // args.vocab)
    if args.mode == "time" and not args.chunk_rows and args.device == "cpu":
        rows = max(1, tokens // 4)  # a few chunks at the few tokens a CPU times
    torch.set_num_threads(args.threads)
    result: dict = {"benchmark": "fused_head", "mode": args.mode, "tokens": tokens, "hidden": args.hidden,
                    "vocab": args.vocab, "chunk_rows": rows}
    if args.mode == "memory":
        result["float32"] = {v: account(v, tokens, args.hidden, args.vocab, rows, False) for v in VARIANTS}
        result["bf16_autocast"] = {v: account(v, tokens, args.hidden, args.vocab, rows, True) for v in VARIANTS}
        print(f"head of {tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}, {rows} tokens a chunk "
              f"(fake tensors: computed, not run)")
        print(f"{'precision':<14} {'variant':<11} {'held for bwd MiB':>17} {'peak MiB':>10} {'matmul GFLOP':>13}")
        for precision in ("float32", "bf16_autocast"):
            for v, r in result[precision].items():
                print(f"{precision:<14} {v:<11} {r['held_mib']:>17,.1f} {r['peak_mib']:>10,.1f} "
                      f"{r['matmul_gflop']:>13,.1f}")
    else:
        device = torch.device(args.device)
        result.update(threads=args.threads, device=str(device))
        result["variants"] = timed(tokens, args.hidden, args.vocab, rows, args.repeats, device)
        how = "bf16 autocast on CUDA" if device.type == "cuda" else f"float32 on the CPU, {args.threads} thread(s)"
        print(f"head of {tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}, {rows} tokens a chunk, "
              f"{how}, n={args.repeats} interleaved rounds")
        print(f"{'variant':<11} {'median s':>9} {'mean s, 95% interval':>26} {'x chunked, 95% interval':>26} "
              f"{'max |diff|':>11}")
        for v, r in result["variants"].items():
            (lo, hi), (slo, shi) = r["ci95_s"], r["speedup_ci95"]
            print(f"{v:<11} {r['median_s']:>9.3f} {r['mean_s']:>9.3f} [{lo:.3f}, {hi:.3f}] "
                  f"{r['speedup_vs_chunked']:>9.2f} [{slo:.2f}, {shi:.2f}] {r['max_abs_diff_vs_chunked']:>11.2e}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
