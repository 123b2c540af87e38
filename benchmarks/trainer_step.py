"""The torch trainer's step with its speed-up switches off and on: host reads per minibatch and seconds per step.

Variants (`TorchTrainer` switches; packing and the fused head stay off so only the step differs):
- `plain`: fused_optimizer off, compile off (the CPU default);
- `fused`: fused_optimizer on (fused AdamW, the non-finite skip on the device, metrics read once per step);
- `compiled`: fused plus compile on (each decoder layer compiled, `--backend`, default inductor).

Each runs on the same seeded GRPO-shaped batches (rows of different lengths, right-padded) for `--warmup` steps,
then one step under a TorchFunctionMode that counts the Tensor methods which read values on the host (`item`,
`bool`, `int`, `float`, `tolist`, `numpy`, `cpu`) inside the minibatch loop, split into those of transformers' sdpa
mask builder (the forward's input, not the step's) and the rest, then `--steps` timed steps (the last read of each
step included). Prints one JSON line per variant: reads per minibatch, mean seconds per step with a 95% t-interval
over n = `--steps`. `--smoke`: the `micro` preset, 2 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.overrides import TorchFunctionMode

from factory.config import AlgorithmSpec
from factory.core.algorithms import make_loss
from factory.core.batch import TrainBatch, pack
from factory.core.trainer.compiled import CompiledLayers
from factory.core.trainer.torch_trainer import TorchTrainer
from factory.models.build import build_model
from factory.models.tokenizer import build_tokenizer

READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}
T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 8: 2.36, 10: 2.26, 20: 2.09, 30: 2.05}


class _Reads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.mask, self.step = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            import traceback

            here = traceback.extract_stack(limit=8)  # the caller's frames: is it the forward's mask builder?
            if any("masking_utils.py" in f.filename for f in here):
                self.mask += 1
            else:
                self.step += 1
        return func(*args, **(kwargs or {}))


def _batches(tok, n: int, rows: int, longest: int) -> list[TrainBatch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        seqs = [[torch.randint(4, len(tok) - 1, (int(torch.randint(2, longest, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(rows)] for _ in range(2)]
        b = pack(seqs[0], seqs[1], tok.pad_token_id)
        b.per_token["old_logprobs"] = -torch.rand(b.loss_mask.shape, generator=g) - 1.0
        b.per_token["ref_logprobs"] = -torch.rand(b.loss_mask.shape, generator=g) - 1.0
        b.per_seq["advantages"] = torch.randn(rows, generator=g)
        out.append(b)
    return out


def _interval(xs: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    t = T95[min(T95, key=lambda k: abs(k - len(xs)))]
    return t * statistics.stdev(xs) / len(xs) ** 0.5


def run(variant: str, args: argparse.Namespace, tok, batches: list[TrainBatch]) -> dict:
    fused, compiled = variant != "plain", variant == "compiled"
    torch.manual_seed(0)
    model = build_model(args.preset, tok, seed=0).to(args.device)
    trainer = TorchTrainer(model, lr=1e-5, fused_optimizer="on" if fused else "off",
                           compile="on" if compiled else "off", packing="off", fused_head="off")
    if compiled:
        trainer._layers = CompiledLayers(model, backend=args.backend)
    loss_fn = make_loss(AlgorithmSpec(name="grpo", kl_coef=0.05))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    for b in batches[:args.warmup]:
        trainer.step(b, loss_fn, args.minibatches)
    warm_s = time.perf_counter() - t0
    inner, counts = trainer._minibatch, []

    def counted(mb, fn):
        with _Reads() as r:
            out = inner(mb, fn)
        counts.append((r.step, r.mask))
        return out

    trainer._minibatch = counted
    trainer.step(batches[args.warmup], loss_fn, args.minibatches)
    trainer._minibatch = inner
    times = []
    for b in batches[args.warmup + 1:]:
        sync()
        t = time.perf_counter()
        trainer.step(b, loss_fn, args.minibatches)
        sync()
        times.append(time.perf_counter() - t)
    return {"variant": variant, "preset": args.preset, "device": args.device,
            "step_reads_per_minibatch": [c[0] for c in counts],
            "mask_builder_reads_per_minibatch": [c[1] for c in counts],
            "step_s_mean": statistics.mean(times), "step_s_ci95": _interval(times), "n": len(times),
            "warmup_s": round(warm_s, 2), "rows": args.rows, "minibatches": args.minibatches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default="plain,fused,compiled")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled variant")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--longest", type=int, default=96, help="prompt and completion each up to this many tokens")
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.steps, args.rows, args.longest = "micro", 2, 4, 9
    tok = build_tokenizer()
    batches = _batches(tok, args.warmup + 1 + args.steps, args.rows, args.longest)
    for variant in args.variants.split(","):
        if variant not in ("plain", "fused", "compiled"):
            raise SystemExit(f"--variants: expected plain, fused or compiled, got {variant!r}")
        print(json.dumps(run(variant, args, tok, batches)), flush=True)


if __name__ == "__main__":
    main()
