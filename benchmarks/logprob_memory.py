"""Peak memory of one training micro-batch (forward, target log-probs, entropy, loss, backward) before and after
chunked log-probs (`factory/core/trainer/logprobs.py`), and after with activation checkpointing.

The model is a randomly initialised Qwen2-0.5B shape (`benchmarks/gpu/common.py` SHAPES, vocabulary 151,936; nothing
is downloaded); `--layers` overrides its depth (the log-prob part does not depend on it). Variants:

- `old`: the previous `token_logprobs` (full fp32 logits, log-softmax and its exp over the vocabulary, the entropy's
  graph kept through backward), kept here as `old_token_logprobs`, the reference;
- `new`: `factory.core.trainer.torch_trainer.token_logprobs` (chunked, checkpointed per chunk);
- `new+ac`: `new` with `trainer.activation_checkpointing` (transformers' non-reentrant checkpointing per layer);
- `fused`: `new` with `trainer.fused_head` (`factory/core/trainer/fused_head.py`: logits kept for backward where they
  fit `logprobs.keep_budget`, else recomputed).

Each variant runs in a fresh subprocess, measured the same way: on CUDA `torch.cuda.max_memory_allocated` minus the
memory allocated once the model and batch are built; on the CPU the peak RSS (VmHWM, reset through
/proc/self/clear_refs once the model is built; else ru_maxrss) minus the RSS at that point. The loss is a
policy-gradient loss with seeded random advantages, the same in every variant, so `loss` and `grad_norm` must agree
between them (to float reassociation). Prints a table, then one JSON line. `--smoke`: the `micro` shape, seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from factory.core.batch import TrainBatch  # noqa: E402

VARIANTS = ("old", "new", "new+ac", "fused")
DEFAULT_VARIANTS = ("old", "new", "new+ac")  # `fused` when asked: --variants new,fused
MB = 1 << 20


def old_token_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """The reference: `token_logprobs` as it was before chunking, line for line."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1, :]
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    targets = batch.input_ids[:, 1:]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy


def _rss() -> int:
    """Resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: clear_refs 5); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """Peak resident bytes since the last reset (VmHWM), or since the start (ru_maxrss) without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(variant: str, shape: str, layers: int | None, batch: int, seq: int, dtype: str, device: str,
            chunk_elements: int | None) -> dict:
    """One micro-batch of `variant` in this process: peak memory above the built model and batch, seconds, loss."""
    from benchmarks.gpu.common import random_model
    from factory.core.trainer.logprobs import CHUNK_ELEMENTS, enable_activation_checkpointing, token_logprobs

    dev = torch.device(device)
    overrides = {"num_hidden_layers": layers} if layers else {}
    model = random_model(shape, seed=0, **overrides).to(dev, dtype=getattr(torch, dtype)).train()
    if variant == "new+ac":
        enable_activation_checkpointing(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
    mb = TrainBatch(ids, torch.ones_like(ids), torch.ones(batch, seq - 1, dtype=torch.bool, device=dev))
    advantages = torch.randn(batch, 1, generator=g).to(dev)
    chunk = chunk_elements or CHUNK_ELEMENTS

    def step() -> tuple[float, float, float]:
        if variant == "old":
            logp, entropy = old_token_logprobs(model, mb, 1.0, with_entropy=True)
        else:
            logp, entropy = token_logprobs(model, mb, 1.0, with_entropy=True, chunk_elements=chunk,
                                           fused=variant == "fused")
        mask = mb.loss_mask.float()
        loss = -(advantages * logp * mask).sum() / mask.sum()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        # As the trainer does: the entropy metric is read after backward (the old one kept its graph until here).
        assert entropy is not None
        ent = (entropy * mask).sum() / mask.sum()
        return float(loss.detach()), float(grad_norm), float(ent)

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        t0 = time.perf_counter()
        loss, grad_norm, ent = step()
        torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        peak, how = torch.cuda.max_memory_allocated(dev) - base, "cuda max_memory_allocated"
    else:
        reset = _reset_peak()
        base = _rss()
        start_peak = _peak_rss()
        t0 = time.perf_counter()
        loss, grad_norm, ent = step()
        seconds = time.perf_counter() - t0
        peak = _peak_rss() - base
        how = "peak RSS (VmHWM after clear_refs)" if reset else "peak RSS (ru_maxrss since start)"
        if not reset and start_peak > base:
            how += f"; the build's peak {start_peak / MB:.0f} MiB hides lower peaks"
    return {"variant": variant, "peak_mib": round(peak / MB, 1), "base_mib": round(base / MB, 1),
            "seconds": round(seconds, 2), "loss": loss, "grad_norm": grad_norm, "entropy": ent, "measured": how}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the micro shape at 2x64 tokens, seconds")
    p.add_argument("--shape", default="qwen2-0.5b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per variant")
    p.add_argument("--chunk-elements", type=int, default=None, help="logits per chunk (default: the trainer's)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.batch, args.seq, args.chunk_elements = "micro", 2, 64, 512 * 16  # 16 rows: several chunks
    variants = [v for v in args.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"--variants: expected some of {', '.join(VARIANTS)}, got {bad}")
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(measure(args.child, args.shape, args.layers, args.batch, args.seq, args.dtype, args.device,
                                 args.chunk_elements)))
        return {}
    rows = []
    for v in variants:  # a fresh process each: no allocator cache or peak carried over from another variant
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", v, "--shape", args.shape, "--batch",
               str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype, "--device", args.device,
               "--threads", str(args.threads)]
        cmd += ["--layers", str(args.layers)] if args.layers else []
        cmd += ["--chunk-elements", str(args.chunk_elements)] if args.chunk_elements else []
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            raise SystemExit(f"variant {v} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"one micro-batch: {args.shape} layers={args.layers or 'all'} {args.batch}x{args.seq} {args.dtype} "
          f"on {args.device}, {args.threads} thread(s); {rows[0]['measured']}")
    print(f"{'variant':<8} {'peak MiB':>10} {'seconds':>8} {'loss':>14} {'grad_norm':>14} {'entropy':>10}")
    for r in rows:
        print(f"{r['variant']:<8} {r['peak_mib']:>10.1f} {r['seconds']:>8.2f} {r['loss']:>14.8f} "
              f"{r['grad_norm']:>14.8f} {r['entropy']:>10.5f}")
    result = {"benchmark": "logprob_memory", "shape": args.shape, "layers": args.layers, "batch": args.batch,
              "seq": args.seq, "dtype": args.dtype, "device": args.device, "threads": args.threads,
              "variants": {r["variant"]: {k: r[k] for k in ("peak_mib", "seconds", "loss", "grad_norm", "entropy")}
                           for r in rows}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
