"""Issue 34's parts of the device check (`check.py --parts trainer_rl,handoff,grpo_step`): what a user of an RL run
feels, today's code and the new code side by side in one call.

- trainer_rl: the torch trainer (`TorchTrainer`, GRPO's loss) on RL-shaped batches of the Qwen2-0.5B shape: rows of a
  prompt and a completion whose lengths are each uniform in 100-1024 (nano-vllm's benchmark distribution), random
  ids, the loss on completion tokens. Real tokens (prompt + completion) are counted, padding is not; MFU is
  6 x params x real tokens/s against `--peak-tflops` (989: H100 SXM dense bf16, the convention of check.py, also on
  an H200). Today's path (trainer switches packing / fused_head / compile / fused_optimizer "off") and the new one
  ("on") on the same batches; `--profile` writes the top kernels of one step of each to `trainer_profile.txt`.
- handoff: one AdamW step's weights of the 0.5B shape handed to an engine's own serving-dtype parameters: in process
  (one cast-copy per storage, `load_state_dict_into`, and the same through `PagedEngine.update_weights`), by the
  shared buffer (`factory.core.weights.shared`, the reader in a spawned process; an import failure is recorded) and
  by the codec in bf16 (host snapshot in kept buffers, encode, bytes, decode, apply, load; full and delta).
- grpo_step: one GRPO step of the 0.5B shape with random weights (so rewards mean nothing: a stand-in reward on
  token ids), 32 prompts (100-512 random ids) x 8 samples, up to 512 new tokens at temperature 1, timed by phase:
  generate, score (rewards, group advantages, packing), train (one optimizer step per `--grpo-minibatch-rows`
  rows), handoff. Today's code: `ContinuousEngine`, trainer switches off, the codec as `ServerProducer` ran it
  (fresh fp32 host copies, delta, apply into a host copy, load). The new code: `make_engine` (the paged engine in
  bf16), switches on, the in-process cast-copy. Both sides score and train on the new side's samples (the same
  batch); a side whose generation passes its budget stops, and its time is extrapolated from the tokens it made
  (`*_generate_extrapolated`).

Every part keeps to its budget (`BUDGET_S`; a phase that would pass it is skipped and says so) and reports what it
measured so far through `save`, so a call cut off still leaves figures. `--smoke` runs the same code on the CPU
with the `micro` shape (the new side's `compile` stays off there: inductor on a 2-core CPU costs minutes).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import n_params, random_model
from engine_check import word_tokenizer, workload

SWITCHES = ("packing", "fused_head", "compile", "fused_optimizer")
BUDGET_S = {"trainer_rl": 120, "handoff": 60, "grpo_step": 240}  # 420 s of one call's 480
GRPO = {"prompts": 32, "samples": 8, "new_tokens": 512, "min_prompt": 100, "max_prompt": 512, "today_budget_s": 100}
GRPO_SMOKE = {"prompts": 4, "samples": 2, "new_tokens": 8, "min_prompt": 4, "max_prompt": 12, "today_budget_s": 60}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rl-rows", type=int, default=8, help="trainer_rl: rows per optimizer step")
    ap.add_argument("--rl-steps", type=int, default=4, help="trainer_rl: timed steps per side (after 2)")
    ap.add_argument("--grpo-minibatch-rows", type=int, default=8,
                    help="grpo_step: rows per optimizer step of the train phase (the trainer has no accumulation)")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def switches(on: bool, smoke: bool) -> dict[str, str]:
    """The trainer's speed-up switches of one side (the new side's compile stays off on the CPU smoke run)."""
    return {s: "on" if on and not (smoke and s == "compile") else "off" for s in SWITCHES}


def shape(a: argparse.Namespace) -> str:
    return "micro" if a.smoke else "qwen2-0.5b"


def grpo_loss():
    from factory.config import parse_spec
    from factory.core.algorithms import make_loss

    return make_loss(parse_spec({}).algorithm.for_rollout(1024))


def rl_batch(prompts: list[list[int]], completions: list[list[int]], gen: torch.Generator):
    """A GRPO-shaped batch: behaviour logprobs near the model's and +-1 advantages, the loss on completions."""
    from factory.core.batch import pack

    old = [(-11.0 + 0.1 * torch.randn(len(c), generator=gen)).tolist() for c in completions]
    adv = (torch.randint(0, 2, (len(prompts),), generator=gen) * 2 - 1).float().tolist()
    return pack(prompts, completions, 0, {"old_logprobs": old}, {"advantages": adv})


def real_tokens(batch) -> int:
    return int(batch.attention_mask.sum())


def free(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ trainer MFU on RL-shaped batches


def part_trainer_rl(a: argparse.Namespace, dev: torch.device, save: Callable[[dict], None]) -> dict:
    from factory.core.trainer.torch_trainer import TorchTrainer

    t_part = time.perf_counter()
    rows, steps = (2, 1) if a.smoke else (a.rl_rows, a.rl_steps)
    lo, hi = (4, 24) if a.smoke else (100, 1024)
    model = random_model(shape(a), seed=0)
    vocab, params = model.config.vocab_size, n_params(model)
    gen = torch.Generator().manual_seed(3)
    batches = []
    for k in range(2):
        prompts, _ = workload(rows, lo, hi, vocab - 2, seed=10 + k)
        outs, lengths = workload(rows, lo, hi, vocab - 2, seed=20 + k)
        batches.append(rl_batch(prompts, [o[:m] for o, m in zip(outs, lengths, strict=True)], gen))
    out: dict = {"shape": shape(a), "params": params, "rows": rows, "steps": steps, "lengths": f"uniform {lo}-{hi}",
                 "peak_tflops": a.peak_tflops, "mfu_convention": "6 x params x real tokens/s / peak (H100 SXM dense "
                 "bf16 989 TFLOP/s)", "real_tokens_per_step": [real_tokens(b) for b in batches],
                 "padded_tokens_per_step": [b.input_ids.numel() for b in batches]}
    loss = grpo_loss()
    for side, on in (("today", False), ("new", True)):
        if time.perf_counter() - t_part > BUDGET_S["trainer_rl"] * 0.6:
            out[f"{side}_skipped"] = "past 60% of the part's budget"
            continue
        torch.manual_seed(0)
        trainer = TorchTrainer(copy.deepcopy(model).to(dev), lr=1e-6, precision="bf16" if dev.type == "cuda" else
                               "fp32", **switches(on, a.smoke))
        out[f"{side}_switches"] = {s: trainer.uses(s) for s in SWITCHES}
        t0 = time.perf_counter()
        for i in range(2):  # warm-up: allocator, kernels, compilation
            trainer.step(batches[i % 2], loss)
        sync(dev)
        out[f"{side}_warmup_s"] = time.perf_counter() - t0
        times, tokens = [], []
        for i in range(steps):
            b = batches[i % 2]
            sync(dev)
            t0 = time.perf_counter()
            trainer.step(b, loss)
            sync(dev)
            times.append(time.perf_counter() - t0)
            tokens.append(real_tokens(b))
        tps = sum(tokens) / sum(times)
        out.update({f"{side}_tokens_per_s": tps, f"{side}_step_s": sorted(times)[len(times) // 2],
                    f"{side}_mfu": 6 * params * tps / (a.peak_tflops * 1e12) if dev.type == "cuda" else None,
                    f"{side}_peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda"
                    else None})
        if a.profile:
            out[f"{side}_profile_top"] = profile_step(trainer, batches[0], loss, dev, side, a)
        save(out)
        del trainer
        free(dev)
    if "today_tokens_per_s" in out and "new_tokens_per_s" in out:
        out["new_vs_today"] = out["new_tokens_per_s"] / out["today_tokens_per_s"]
    return out


def profile_step(trainer, batch, loss, dev: torch.device, side: str, a: argparse.Namespace) -> list:
    """The top kernels of one trainer step, appended to `trainer_profile.txt` beside --out."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        trainer.step(batch, loss)
        sync(dev)
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    path = (a.out.parent if a.out else Path.cwd()) / "trainer_profile.txt"
    with path.open("w" if side == "today" else "a") as f:
        f.write(f"== {side}: one trainer step ({len(batch)} rows, {real_tokens(batch)} real tokens, switches "
                f"{switches(side == 'new', a.smoke)}), sorted by {key}\n\n{events.table(sort_by=key, row_limit=25)}\n")
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:5]
    return [[e.key[:80], round(getattr(e, key) / 1e3, 3)] for e in top]  # ms


# ------------------------------------------------------------------ one step's weights handed over


def stepped_model(a: argparse.Namespace, dev: torch.device):
    """The 0.5B shape on `dev` after one real AdamW step (lr 1e-6), and its state before the step (on the host)."""
    from trainer_throughput import nll, random_batch

    from factory.core.trainer.torch_trainer import TorchTrainer

    model = random_model(shape(a), seed=0).to(dev)
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    trainer = TorchTrainer(model, lr=1e-6, precision="bf16" if dev.type == "cuda" else "fp32",
                           **switches(False, a.smoke))
    trainer.step(random_batch(2, 64, model.config.vocab_size, torch.Generator().manual_seed(1)), nll)
    del trainer  # AdamW's moments
    free(dev)
    return model, before


def median_time(fn: Callable[[], object], n: int, dev: torch.device) -> float:
    times = []
    for _ in range(n):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.numel() else True


def part_handoff(a: argparse.Namespace, dev: torch.device, save: Callable[[dict], None]) -> dict:
    from factory.core.rollout.engines.paged.serving import serving_dtype
    from factory.core.weights import codec

    n = 3 if a.smoke else 5
    model, before = stepped_model(a, dev)
    dtype = serving_dtype(dev, "bf16", torch.float32)
    state = model.state_dict()
    out: dict = {"shape": shape(a), "params": n_params(model), "dtype": str(dtype).removeprefix("torch."),
                 "repeats": n, "codec_workers": codec.WORKERS}

    out.update(in_process(model, state, dtype, dev, n))
    free(dev)
    save(out)

    try:
        out.update(shared_buffer(state, dtype, dev, n))
    except Exception as e:  # noqa: BLE001 - another engineer's module; its failure is a figure, not a crash
        out["shared_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    save(out)

    out.update(codec_handoff(model, before, dtype, dev, n))
    return out


def in_process(model, state: dict, dtype: torch.dtype, dev: torch.device, n: int) -> dict:
    """The cast-copy alone (`load_state_dict_into`), then through an idle engine's `update_weights` (what
    `OverlappedProducer.publish` waits for); seconds (medians of `n`) and bit-exactness."""
    from factory.core.rollout.engines.paged.engine import make_engine
    from factory.core.rollout.engines.paged.serving import serving_copy
    from factory.core.rollout.engines.sequences import load_state_dict_into

    target = serving_copy(model, dtype)
    seconds = median_time(lambda: load_state_dict_into(target, state), n, dev)
    exact = all(bits_equal(v, state[k].detach().to(dtype) if v.is_floating_point() else state[k])
                for k, v in target.state_dict().items())
    engine = make_engine(target, word_tokenizer(model.config.vocab_size), max_batch=4, max_seq_len=128,
                         precision="bf16", kv_budget=64 << 20, owns_model=True)
    version = iter(range(1, 10**6))

    def through_engine() -> None:
        fut = engine.update_weights(state, next(version), "in_flight")
        engine.step()  # not started: the caller's step applies it
        fut.result(timeout=60)

    return {"in_process_s": seconds, "in_process_bit_exact": exact, "engine": type(engine).__name__,
            "engine_update_s": median_time(through_engine, n, dev)}


def _shared_reader(handle, layout: dict, dtype: torch.dtype, device: str, jobs, results) -> None:
    """The reader process: attaches once, then reads each announced version into its own tensors."""
    from factory.core.weights.shared import SharedWeightsReader

    state = {k: torch.empty(shape, dtype=dt, device=device) for k, (shape, dt) in layout.items()}
    reader = SharedWeightsReader.attach(handle)
    while (job := jobs.get(timeout=120)) is not None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = reader.read_into(state)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        results.put((job, got, seconds, checksum(state)))


def checksum(state: dict) -> float:
    """A cheap fingerprint of a state's values (every name, tied ones too), to see the reader got what was written."""
    return sum(float(t.double().sum()) for t in state.values())


def shared_buffer(state: dict, dtype: torch.dtype, dev: torch.device, n: int) -> dict:
    """Publish through the shared buffer, read in a spawned process: seconds each side (medians of `n`)."""
    from factory.core.weights.shared import SharedWeightsWriter

    writer = SharedWeightsWriter.create(state, dtype, dev)
    layout = {k: (tuple(v.shape), dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_shared_reader, args=(writer.handle(), layout, dtype, str(dev), jobs, results),
                       daemon=True)
    proc.start()
    try:
        pub, read = [], []
        for v in range(1, n + 1):
            sync(dev)
            t0 = time.perf_counter()
            writer.publish(state, v)
            sync(dev)
            pub.append(time.perf_counter() - t0)
            jobs.put(v)
            job, got, seconds, total = results.get(timeout=120)
            if got != v:
                raise RuntimeError(f"the reader read version {got} after version {v} was published")
            want = checksum({k: x.detach().to(dtype) if x.is_floating_point() else x for k, x in state.items()})
            if abs(total - want) > 1e-9 * max(1.0, abs(want)):
                raise RuntimeError(f"the reader's values sum to {total!r}, the published ones to {want!r}")
            read.append(seconds)
        jobs.put(None)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return {"shared_publish_s": sorted(pub)[n // 2], "shared_read_s": sorted(read)[n // 2],
            "shared_s": sorted(pub)[n // 2] + sorted(read)[n // 2]}


def codec_handoff(model, before: dict, dtype: torch.dtype, dev: torch.device, n: int) -> dict:
    """Full and delta through the codec in `dtype`: the sender's snapshot + encode + bytes, the receiver's parse +
    apply into its host copy + load into its parameters; seconds (medians of `n`), MB, bit-exactness."""
    from factory.core.rollout.engines.paged.serving import serving_copy
    from factory.core.rollout.engines.sequences import load_state_dict_into
    from factory.core.weights import WeightUpdate, apply_update, encode_delta, encode_full
    from factory.core.weights.staging import HostStaging

    staging = HostStaging(None if dtype == torch.float32 else dtype)
    prev = staging.snapshot(before)  # version 1: what the receiver holds
    engine = serving_copy(model, dtype)
    out: dict = {}
    for kind in ("full", "delta"):
        sent, recv, size, exact = [], [], 0, True
        for _ in range(n):
            host = {k: v.clone() for k, v in prev.items()}  # the receiver's copy of version 1
            sync(dev)
            t0 = time.perf_counter()
            new = staging.snapshot(model.state_dict(), keep=prev)
            update = encode_full(new, 2) if kind == "full" else encode_delta(prev, new, 2, 1)
            wire = update.to_bytes()
            sent.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = apply_update(host, WeightUpdate.from_bytes(wire), 1, inplace=True)
            load_state_dict_into(engine, got)
            sync(dev)
            recv.append(time.perf_counter() - t0)
            size = len(wire)
            exact = exact and all(bits_equal(got[k], v) for k, v in new.items())
        out.update({f"codec_{kind}_send_s": sorted(sent)[n // 2], f"codec_{kind}_receive_s": sorted(recv)[n // 2],
                    f"codec_{kind}_s": sorted(sent)[n // 2] + sorted(recv)[n // 2], f"codec_{kind}_mb": size / 1e6,
                    f"codec_{kind}_bit_exact": exact})
    return out
