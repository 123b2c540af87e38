"""Trainer throughput: tokens/s and MFU of Factory's trainers on a randomly initialised Qwen2-0.5B-shaped model.

Every mode runs the same work: fixed-size batches of random token ids (`--batch` rows x `--seq` tokens per
optimizer step, every position a target), a token-mean NLL loss, AdamW; `--warmup` steps, then `--steps` timed
ones. Each mode runs in its own processes, started by `factory.core.trainer.launch.run_ranks` (torchrun):

- single: `DistributedTrainer` alone in one process (no wrapping; bf16 autocast on CUDA), `--micro` rows per
  forward, gradient accumulation up to `--batch`;
- ddp / fsdp: `DistributedTrainer` (strategy ddp / FSDP2 `fully_shard` per decoder layer, bf16 mixed precision
  on CUDA) on `--ranks` ranks, each rank `--micro` rows per forward, `--batch` rows per optimizer step in all;
- megatron: `make_megatron_trainer` (megatron-core GPTModel, local spec, tensor_parallel 1, bf16 autocast on
  CUDA), one process. `MegatronTrainer` has no gradient accumulation, so each `--micro`-row micro-batch is one
  optimizer step (same tokens per second of work, `--batch / --micro` times as many AdamW steps). Its copy of
  the trained weights back into the HF model (`sync_hf`, after every `step()` in a run) is left out of the step
  times and timed once on its own (`megatron_hf_sync_s`).

tokens/s counts every token of the batch (prompt and target alike: all are trained here). MFU = 6 x params x
tokens/s / (peak FLOP/s x GPUs), params counted once (the tied embedding is the lm_head matmul), attention's
score FLOPs left out; peak `--peak-tflops` per GPU (989: H100 SXM bf16 dense). The trainers' own forward is
measured as it is, so the fp32 log-softmax and entropy over the 151936-token vocab (`token_logprobs`) count
against MFU.

On one H100 (a venv with CUDA torch, transformers, and megatron-core for the megatron row):

    python benchmarks/gpu/trainer_throughput.py                 # single + megatron; ddp/fsdp need >= 2 GPUs
    python benchmarks/gpu/trainer_throughput.py --ranks 8       # an 8-GPU node: all four modes

On a node with one GPU, ddp and fsdp are skipped (NCCL cannot put two ranks on one GPU, and one rank is the
single mode): the table says so. `--smoke`: the `micro` shape, CPU, gloo, 2 ranks, 3+3 steps (fp32, Megatron with
the two CPU stand-ins of tests/core/test_megatron.py): proves the code path, the numbers mean nothing.

What was NOT run in this repository's sessions: any of it on a GPU (no GPU was lent); only --smoke, on CPU.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import H100_BF16_DENSE_TFLOPS, n_params, random_model, sync  # noqa: E402

from factory.core.batch import TrainBatch  # noqa: E402

MODES = ("single", "ddp", "fsdp", "megatron")


def nll(logp: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean negative log-likelihood of the targets (a `LossFn`)."""
    mask = batch.loss_mask.to(logp.device).float()
    return -(logp * mask).sum() / mask.sum().clamp(min=1.0), {}


def random_batch(rows: int, seq: int, vocab: int, gen: torch.Generator) -> TrainBatch:
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    return TrainBatch(ids, torch.ones_like(ids), torch.ones(rows, seq - 1, dtype=torch.bool))


def _cpu_stand_ins() -> None:
    """Megatron's two CUDA assumptions on CPU, replaced as tests/core/test_megatron.py `_cpu_stand_ins` does (smoke
    only): the rotary table's device and the CUDA RNG tracker fork around (p = 0) attention dropout."""
    import megatron.core.tensor_parallel.random as mrandom

    class NoForkTracker:
        def fork(self, name: str = "model-parallel-rng"):
            return contextlib.nullcontext()

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = NoForkTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def worker(a: argparse.Namespace) -> None:
    """One rank of one mode (under torchrun); rank 0 prints a JSON line with its timings."""
    import torch.distributed as dist

    from factory.core.trainer.distributed import DistributedTrainer, init_ranks

    cuda = torch.cuda.is_available()
    shape = "micro" if a.smoke else a.model
    if a.mode == "megatron":
        from factory.config import parse_spec
        from factory.core.trainer.megatron import make_megatron_trainer

        init_ranks(threads=a.threads)
        if not cuda:
            _cpu_stand_ins()
        model = random_model(shape, seed=0)
        params = n_params(model)
        spec = parse_spec({"model": {"preset": "micro"}, "algorithm": {"lr": a.lr},
                           "trainer": {"backend": "megatron", "precision": "bf16" if cuda else "fp32"}})
        trainer = make_megatron_trainer(spec, model, device=None if cuda else "cpu")
        # timed without the copy back into the HF model after every step() call (one per micro-batch here);
        # that copy is timed once on its own below
        hf_model, trainer.hf_model = trainer.hf_model, None
        rank, world, per_call, calls = 0, 1, a.micro, a.batch // a.micro
    else:
        rank, world = init_ranks(threads=a.threads)
        model = random_model(shape, seed=0)
        params = n_params(model)  # before sharding
        accum = max(1, a.batch // (a.micro * world))
        trainer = DistributedTrainer(model, lr=a.lr, aggregation="token_mean", strategy=a.mode if world > 1 else
                                     "fsdp", grad_accum=accum, precision="bf16" if cuda else "fp32")
        per_call, calls = a.batch, 1
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank
    batches = [random_batch(per_call, a.seq, vocab, gen) for _ in range(min(4, a.warmup + a.steps))]
    times = []
    for i in range(a.warmup + a.steps):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            metrics = trainer.step(batches[i % len(batches)], nll)
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    hf_sync_s = None
    if a.mode == "megatron":
        trainer.hf_model = hf_model
        sync()
        t0 = time.perf_counter()
        trainer.sync_hf()
        sync()
        hf_sync_s = time.perf_counter() - t0
    if rank == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        print(json.dumps({"mode": a.mode, "world": world, "params": params, "step_s": times,
                          "tokens_per_step": a.batch * a.seq, "loss": metrics["loss"], "peak_mem_gib": peak,
                          "hf_sync_s": hf_sync_s}), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_mode(mode: str, ranks: int, a: argparse.Namespace) -> dict:
    from factory.core.trainer.launch import run_ranks

    args = ["--worker", mode, "--model", a.model, "--batch", a.batch, "--micro", a.micro, "--seq", a.seq,
            "--steps", a.steps, "--warmup", a.warmup, "--lr", a.lr, "--threads", a.threads]
    if a.smoke:
        args.append("--smoke")
    outs = run_ranks(ranks, Path(__file__).resolve(), [str(x) for x in args], threads=a.threads,
                     timeout=a.timeout)
    return json.loads(outs[0].stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="micro shape, CPU, gloo, 2 ranks, a few steps")
    ap.add_argument("--model", default="qwen2-0.5b", choices=("qwen2-0.5b", "micro"))
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--ranks", type=int, default=None, help="ranks for ddp/fsdp (default: the GPUs here; smoke 2)")
    ap.add_argument("--batch", type=int, default=None, help="rows per optimizer step (default 32; smoke 8)")
    ap.add_argument("--micro", type=int, default=None, help="rows per forward (default 4; smoke 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 1024; smoke 32)")
    ap.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 10; smoke 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                    help="peak FLOP/s per GPU in TFLOP/s for MFU (989: H100 SXM bf16 dense)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per mode")
    ap.add_argument("--worker", choices=MODES, dest="mode", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    d = (8, 2, 32, 3, 1) if a.smoke else (32, 4, 1024, 10, 3)
    a.batch, a.micro, a.seq = a.batch or d[0], a.micro or d[1], a.seq or d[2]
    a.steps, a.warmup = a.steps or d[3], a.warmup if a.warmup is not None else d[4]
    if a.mode:
        worker(a)
        return 0
    if a.smoke and torch.cuda.is_available():
        print("note: --smoke with CUDA present still runs on CUDA (bf16)", flush=True)
    gpus = torch.cuda.device_count()
    ranks = a.ranks or (2 if a.smoke or not gpus else gpus)
    if gpus and ranks > gpus:
        ap.error(f"--ranks {ranks}: only {gpus} GPU(s) here (one rank per GPU)")
    if a.batch % a.micro:
        ap.error(f"--batch {a.batch} must be a multiple of --micro {a.micro}")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        ap.error(f"--modes: unknown {bad}; expected a subset of {', '.join(MODES)}")
    rows, skipped = [], {}
    for mode in modes:
        if mode in ("ddp", "fsdp") and ranks < 2:
            skipped[mode] = f"needs >= 2 ranks (one per GPU); {gpus} GPU(s) here"
            continue
        if mode in ("ddp", "fsdp") and a.batch % (a.micro * ranks):
            skipped[mode] = f"--batch {a.batch} is not a multiple of --micro x ranks ({a.micro} x {ranks})"
            continue
        if mode == "megatron":
            try:
                import megatron.core  # noqa: F401
            except ImportError as e:
                skipped[mode] = f"megatron-core does not import: {e}"
                continue
        t0 = time.perf_counter()
        try:
            r = run_mode(mode, 1 if mode in ("single", "megatron") else ranks, a)
        except Exception as e:  # noqa: BLE001 - one mode failing is reported, the others still run
            skipped[mode] = f"failed: {str(e).strip().splitlines()[-1][:300]}"
            print(f"{mode}: FAILED\n{e}", flush=True)
            continue
        step_s = sorted(r["step_s"])[len(r["step_s"]) // 2]
        tps = r["tokens_per_step"] / step_s
        gpus_used = r["world"] if torch.cuda.is_available() else 0
        mfu = 6 * r["params"] * tps / (a.peak_tflops * 1e12 * gpus_used) if gpus_used else None
        rows.append({**r, "median_step_s": step_s, "tokens_per_s": tps, "mfu": mfu,
                     "wall_s": time.perf_counter() - t0})
        print(f"{mode}: {tps:,.0f} tokens/s", flush=True)

    print()
    note = ("SMOKE: CPU, micro shape, fp32, gloo ranks: the code path ran, the numbers mean nothing"
            if a.smoke else None)
    if note:
        print(note)
    print(f"{'mode':>9} {'ranks':>5} {'step s':>8} {'tokens/s':>11} {'per GPU':>10} {'MFU':>6} {'peak GiB':>8} "
          f"{'loss':>7}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['mode']:>9} {r['world']:>5} {r['median_step_s']:8.3f} {r['tokens_per_s']:11,.0f} "
              f"{r['tokens_per_s'] / r['world']:10,.0f} {mfu:>6} {mem:>8} {r['loss']:7.3f}")
    for mode, why in skipped.items():
        print(f"{mode:>9}: skipped ({why})")
    for r in rows:
        if r.get("hf_sync_s") is not None:
            print(f"megatron: copying the trained weights back into the HF model (sync_hf, done after every step() "
                  f"call in a run; not in the step times above) took {r['hf_sync_s']:.3f}s once")
    params = rows[0]["params"] if rows else None
    print(f"model {'micro' if a.smoke else a.model} ({params:,} params), {a.batch} rows x {a.seq} tokens per step, "
          f"{a.micro} rows per forward; median of {a.steps} steps after {a.warmup}; MFU = 6 N tokens/s / "
          f"({a.peak_tflops:g} TFLOP/s x GPUs)" if params else "no mode ran")
    print(json.dumps({
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model": "micro" if a.smoke else a.model, "params": params, "tokens_per_step": a.batch * a.seq,
        **{f"tokens_per_s_{r['mode']}": round(r["tokens_per_s"], 1) for r in rows},
        **{f"mfu_{r['mode']}": round(r["mfu"], 4) for r in rows if r["mfu"] is not None},
        **{f"ranks_{r['mode']}": r["world"] for r in rows},
        "megatron_hf_sync_s": next((round(r["hf_sync_s"], 4) for r in rows if r.get("hf_sync_s") is not None), None),
        "skipped": skipped, "peak_tflops": a.peak_tflops, "smoke": a.smoke, "note": note,
    }))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
