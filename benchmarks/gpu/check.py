"""The device check: one command that measures, side by side in one run on one GPU, what issue 22 asks of Factory
on a GPU, and prints a short table and one JSON line.

Parts (each guarded: a part that fails records its error under its key and the others still run):

- grpo: the quickstart's GRPO stage (examples/quickstart.yaml; no lake, no MLflow): one SFT warm start on the CPU
  (`factory.core.sft.run_sft`, the quickstart's stop rule), then `factory.core.loop.train_rl` from those same
  weights with the same seed twice: on the device (model placed with `.to(device)`, `spec.device` set to it) and
  on the CPU (`--cpu-threads` torch threads; the quickstart's trainer.threads is 1), `--grpo-steps` each (default
  100: the quickstart's 200 per side do not fit 8 minutes beside the SFT). Steps/s of each and held-out greedy
  accuracy (`factory.core.evaluate`) of each; `same_band` when they are within `band_abs`.
- trainer: tokens/s and MFU (6 x params x tokens/s / `--peak-tflops`) of the torch trainer (`DistributedTrainer`
  in one process, bf16 autocast over fp32 weights) on the Qwen2-0.5B shape, random tokens, every position a target
  (trainer_throughput.py's batches and loss); the Megatron trainer too where megatron-core imports.
- engine (`engine_check.py`): the paged engine (bf16 weights on CUDA) on nano-vllm's benchmark workload (256
  sequences, prompt and output lengths uniform in 100-1024, the Qwen2-0.5B shape with its 151,936-token
  vocabulary): tokens/s, the ratio to transformers `generate` on the same prompts (a subset), the ratio to the
  decode roofline, peak memory, the engine's stats; `--profile` writes the top kernels of 50 decode steps.
- publish: seconds to publish one step's weights of the 0.5B shape after a real AdamW step, in bf16 (what the
  servers serve): full (device -> pinned host, `encode_full`, bytes) and the lossless delta against the previous
  version (`encode_delta`, bytes), with sizes and a bit-exact check of the delta applied to the previous version.
- logprobs: torch vs Megatron per-token log-probs of the same weights and batch (bf16 on a GPU), max abs diff;
  skipped with the reason where megatron-core does not import.

- trainer_rl, handoff, grpo_step (issue 34; rl_check.py and grpo_step_check.py say what each measures): the
  trainer's MFU on RL-shaped batches (real tokens only), switches off vs on; one step's weights handed over in
  process, by the shared buffer and by the codec; one GRPO step by phase, today's code vs the new one.
- gap (issue 35; gap_check.py): the sampler/trainer gap of the paged engine serving in bf16 against the trainer's
  log-probs of the same tokens (bf16 autocast and fp32) on the 0.5B shape: mean/max |d|, k3 KL, out-of-range share.

`gpu_count` puts `factory validate`'s torch-free GPU count (factory/infra/gpus.py) beside torch's.

The run's device follows Factory's rule: `factory.infra.device.run_device(spec.resolved)` picks it (device: auto),
and each component computes on the device of the model it is given. `--smoke`: the same code paths on the CPU with tiny
shapes and few steps (seconds); tests/benchmarks/test_gpu_check.py runs it so the kit cannot rot. The JSON is also
written to `--out` after each part, so a run stopped at its time limit still leaves what it measured.

On the lent GPU machine (benchmarks/gpu/README.md has the `device` tool command): the wheels from kit.sh on
PYTHONPATH, then `python benchmarks/gpu/check.py --out $OUT/check.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for p in (ROOT, ROOT / "benchmarks", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import lakeless  # noqa: E402

STOOD_IN = lakeless.install()  # before Factory's imports: the lake's duckdb where it is absent

import torch  # noqa: E402
from common import H100_BF16_DENSE_TFLOPS, n_params, random_model  # noqa: E402
from engine_check import add_arguments as engine_arguments  # noqa: E402
from engine_check import part_engine  # noqa: E402
from gap_check import part_gap  # noqa: E402
from grpo_step_check import part_grpo_step  # noqa: E402
from rl_check import add_arguments as rl_arguments  # noqa: E402
from rl_check import part_handoff, part_trainer_rl  # noqa: E402
from trainer_throughput import _cpu_stand_ins, nll, random_batch  # noqa: E402

from factory.config import apply_overrides, load_spec, parse_spec  # noqa: E402
from factory.infra.device import describe, prepare, run_device, to_host  # noqa: E402
from factory.infra.gpus import count_gpus  # noqa: E402

QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SMOKE_GRPO = {"model.preset": "micro", "task.n_train": 200, "task.n_eval": 24, "sft.steps": 10,
              "sft.stop_at_accuracy": None, "rollout.prompts_per_step": 4, "algorithm.group_size": 2}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ (a) the quickstart's GRPO stage


def part_grpo(a: argparse.Namespace, dev: torch.device) -> dict:
    from factory.core.evaluate import evaluate
    from factory.core.loop import train_rl
    from factory.core.rollout.engines.embedded import EmbeddedEngine
    from factory.core.sft import run_sft
    from factory.envs.tasks import make_task_splits
    from factory.models.build import build_model
    from factory.models.tokenizer import tokenizer_for

    cpu = torch.device("cpu")
    spec = apply_overrides(load_spec(QUICKSTART), {**(SMOKE_GRPO if a.smoke else {}),
                                                   "schedule.steps": a.grpo_steps, "device": "cpu"})
    splits = make_task_splits(spec.task, spec.seed)
    tok = tokenizer_for(spec.task.name)
    n_new = spec.rollout.max_new_tokens
    torch.set_num_threads(a.cpu_threads)
    start = build_model(spec.model.preset, tok, seed=spec.seed, max_positions=spec.model.max_positions)
    t0 = time.perf_counter()
    sft = run_sft(start, tok, splits.train, spec.sft, spec.seed, max_new_tokens=n_new)
    out: dict = {"grpo_steps": a.grpo_steps, "sft_steps": int(sft["steps"]), "sft_s": time.perf_counter() - t0,
                 "sft_accuracy": evaluate(EmbeddedEngine(start, tok), tok, splits.eval, n_new).accuracy,
                 "cpu_threads": a.cpu_threads, "band_abs": a.band}
    sides = [("device", dev), ("cpu", cpu)]
    for side, device in sides:
        try:
            model = copy.deepcopy(start).to(device)
            run = apply_overrides(spec, {"device": str(device)})
            torch.manual_seed(spec.seed)
            sync(device)
            t0 = time.perf_counter()
            records = train_rl(run, model, tok, splits.train)
            sync(device)
            seconds = time.perf_counter() - t0
            out[f"{side}_steps_per_s"] = len(records) / seconds
            out[f"{side}_accuracy"] = evaluate(EmbeddedEngine(model, tok), tok, splits.eval, n_new).accuracy
            out[f"{side}_reward_last"] = records[-1].reward_mean if records else None
        except Exception as e:  # noqa: BLE001 - one side failing still reports the other
            out[f"{side}_error"] = error_text(e)
    if "device_accuracy" in out and "cpu_accuracy" in out:
        out["same_band"] = abs(out["device_accuracy"] - out["cpu_accuracy"]) <= a.band
    out["device"] = str(dev)
    return out


# ------------------------------------------------------------------ (b) trainer tokens/s and MFU


def trainer_shape(a: argparse.Namespace) -> tuple[str, int, int, int, int, int]:
    """(shape, rows per optimizer step, rows per forward, tokens per row, timed steps, warm-up steps)."""
    return ("micro", 4, 2, 32, 2, 1) if a.smoke else ("qwen2-0.5b", a.batch, 4, a.seq, a.steps, 2)


def timed_steps(step: Callable[[], object], n: int, warmup: int, device: torch.device) -> list[float]:
    times = []
    for i in range(warmup + n):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def throughput(tokens_per_step: int, times: list[float], params: int, a: argparse.Namespace,
               dev: torch.device) -> dict:
    step_s = sorted(times)[len(times) // 2]
    tps = tokens_per_step / step_s
    mfu = 6 * params * tps / (a.peak_tflops * 1e12) if dev.type == "cuda" else None
    return {"tokens_per_s": tps, "mfu": mfu, "median_step_s": step_s}


def part_trainer(a: argparse.Namespace, dev: torch.device, shared: dict) -> dict:
    from factory.core.trainer.distributed import DistributedTrainer

    shape, rows, micro, seq, steps, warmup = trainer_shape(a)
    model = random_model(shape, seed=0).to(dev)  # the run places the model; the trainer computes where it is
    params = n_params(model)
    bf16 = dev.type == "cuda"
    trainer = DistributedTrainer(model, lr=1e-5, aggregation="token_mean", grad_accum=rows // micro,
                                 precision="bf16" if bf16 else "fp32", device=dev)
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(rows, seq, model.config.vocab_size, gen) for _ in range(2)]
    it = iter(range(10**9))
    times = timed_steps(lambda: trainer.step(batches[next(it) % 2], nll), steps, warmup, dev)
    shared["trainer"], shared["batches"] = trainer, batches  # publish reuses the stepped model
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return {"shape": shape, "params": params, "precision": "bf16" if bf16 else "fp32", "rows": rows, "micro": micro,
            "seq": seq, "steps": steps, "peak_mem_gib": peak, **throughput(rows * seq, times, params, a, dev)}


def part_megatron_trainer(a: argparse.Namespace, dev: torch.device, shared: dict) -> dict:
    """Megatron's row of (b): one optimizer step per `micro`-row micro-batch (it has no gradient accumulation)."""
    trainer, params = shared["megatron"], shared["megatron_params"]
    shape, rows, micro, seq, steps, warmup = trainer_shape(a)
    gen = torch.Generator().manual_seed(1)
    batch = random_batch(micro, seq, shared["vocab"], gen)
    hf, trainer.hf_model = trainer.hf_model, None  # the copy back into the HF model is not the trainer's step
    try:
        times = timed_steps(lambda: trainer.step(batch, nll), steps, warmup, dev)
    finally:
        trainer.hf_model = hf
    return {"shape": shape, "params": params, "rows": micro, "seq": seq, "steps": steps,
            **throughput(micro * seq, times, params, a, dev)}


# ------------------------------------------------------------------ (d) publishing one step's weights


def published(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state a server is sent, in bf16, copied to the host through pinned buffers (a GPU tensor's host copy
    is new; a CPU tensor already in bf16 would be the live weight itself, hence the clone there)."""
    out = {}
    for k, v in model.state_dict().items():
        host = to_host(v.detach().to(torch.bfloat16))
        out[k] = host if v.device.type == "cuda" else host.clone()
    return out


def part_publish(a: argparse.Namespace, dev: torch.device, shared: dict) -> dict:
    from factory.core.weights import WeightUpdate, apply_update, encode_delta, encode_full

    if "trainer" not in shared:  # the trainer part failed: a trainer of our own
        part_trainer(argparse.Namespace(**{**vars(a), "steps": 1}), dev, shared)
    trainer, batches = shared["trainer"], shared["batches"]
    model = trainer.model
    prev = published(model)
    trainer.step(batches[0], nll)  # the real AdamW step whose weights are published
    sync(dev)
    t0 = time.perf_counter()
    new = published(model)
    full = encode_full(new, version=2).to_bytes()
    full_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    new = published(model)
    delta = encode_delta(prev, new, version=2, base_version=1).to_bytes()
    delta_s = time.perf_counter() - t0

    got = apply_update({k: v.clone() for k, v in prev.items()}, WeightUpdate.from_bytes(delta), 1, inplace=True)
    exact = all(torch.equal(got[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
    return {"full_s": full_s, "delta_s": delta_s, "full_mb": len(full) / 1e6, "delta_mb": len(delta) / 1e6,
            "delta_ratio": len(full) / max(1, len(delta)), "bit_exact": exact, "dtype": "bf16",
            "params": n_params(model)}


# ------------------------------------------------------------------ (e) torch vs Megatron log-probs


def part_logprobs(a: argparse.Namespace, dev: torch.device, shared: dict) -> dict:
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        return {"skipped": f"megatron-core does not import: {e}"}
    from factory.core.trainer.distributed import DistributedTrainer
    from factory.core.trainer.megatron import make_megatron_trainer

    cuda = dev.type == "cuda"
    if not cuda:
        _cpu_stand_ins()  # Megatron's two CUDA assumptions, replaced as the CPU tests do (smoke only)
    shape, rows, micro, seq, *_ = trainer_shape(a)
    model = random_model(shape, seed=0)
    shared["vocab"], shared["megatron_params"] = model.config.vocab_size, n_params(model)
    precision = "bf16" if cuda else "fp32"
    spec = parse_spec({"model": {"preset": "micro"}, "trainer": {"backend": "megatron", "precision": precision}})
    mega = make_megatron_trainer(spec, model, device=dev if cuda else "cpu")
    shared["megatron"] = mega
    model.to(dev)  # after Megatron copied the weights: the torch side computes where the model is placed
    torch_side = DistributedTrainer(model, lr=1e-5, precision=precision, device=dev)
    batch = random_batch(micro, seq, model.config.vocab_size, torch.Generator().manual_seed(2))
    lp_torch = torch_side.logprobs(batch).float()
    lp_mega = mega.logprobs(batch).float().to(lp_torch.device)
    diff = (lp_torch - lp_mega).abs()
    return {"shape": shape, "precision": precision, "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()), "tokens": int(diff.numel())}


# ------------------------------------------------------------------ the run


def error_text(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1:] or None
    where = f" at {Path(last[0].filename).name}:{last[0].lineno}" if last else ""
    return f"{type(e).__name__}: {str(e).strip()[:400]}{where}"


def clean(v: object) -> object:
    if isinstance(v, float):
        return float(f"{v:.6g}") if math.isfinite(v) else str(v)  # 6 significant digits: diffs near 1e-7 stay
    if isinstance(v, dict):
        return {k: clean(x) for k, x in v.items()}
    return v


PARTS = ("trainer", "publish", "engine", "logprobs", "megatron_trainer", "grpo", "trainer_rl", "handoff", "grpo_step",
         "gap")
ISSUE_34 = ("trainer_rl", "handoff", "grpo_step")  # rl_check.py, grpo_step_check.py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="the same code paths on the CPU, tiny shapes (seconds)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--grpo-steps", type=int, default=None, help="GRPO steps per side (default 100, half the "
                    "quickstart's 200, to fit 8 minutes beside the CPU SFT warm start; smoke 2)")
    ap.add_argument("--cpu-threads", type=int, default=1, help="torch threads of the CPU side of grpo")
    ap.add_argument("--band", type=float, default=0.10, help="held-out accuracies within this are one band")
    ap.add_argument("--batch", type=int, default=16, help="trainer rows per optimizer step (4 per forward)")
    ap.add_argument("--seq", type=int, default=1024, help="trainer tokens per row")
    ap.add_argument("--steps", type=int, default=8, help="timed trainer steps (after 2)")
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                    help="peak bf16 FLOP/s per GPU in TFLOP/s for MFU (989: H100/H200 SXM dense)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here (after every part)")
    engine_arguments(ap)
    rl_arguments(ap)
    a = ap.parse_args(argv)
    a.grpo_steps = a.grpo_steps or (2 if a.smoke else 100)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)  # a run's output folder need not exist yet
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if bad := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts: unknown {bad}; expected a subset of {', '.join(PARTS)}")
    torch.set_num_threads(a.cpu_threads)
    spec = parse_spec({"device": "cpu" if a.smoke else "auto"})
    dev = run_device(spec.resolved)  # the run's device, resolved once (factory/infra/device.py)
    prepare(dev)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": describe(dev), "torch": torch.__version__,
                    "cuda": torch.version.cuda, "smoke": a.smoke, "stood_in": STOOD_IN,
                    "note": "SMOKE: CPU, tiny shapes, few steps: the code paths ran, the numbers mean nothing"
                    if a.smoke else None}
    counted = count_gpus()  # `factory validate`'s torch-free count, beside torch's: they must agree on a GPU machine
    result["gpu_count"] = {"torch": torch.cuda.device_count(), "factory": counted.count, "source": counted.source}
    shared: dict = {}

    def partial(name: str, figures: dict) -> None:  # what a long part has measured so far, in case the call is cut
        result[name] = {**figures, "partial": True}
        if a.out:
            a.out.write_text(json.dumps(clean(result)) + "\n")

    runners = {"trainer": lambda: part_trainer(a, dev, shared), "publish": lambda: part_publish(a, dev, shared),
               "engine": lambda: part_engine(a, dev, lambda d: partial("engine", d)),
               "logprobs": lambda: part_logprobs(a, dev, shared),
               "megatron_trainer": lambda: part_megatron_trainer(a, dev, shared),
               "grpo": lambda: part_grpo(a, dev),
               "trainer_rl": lambda: part_trainer_rl(a, dev, lambda d: partial("trainer_rl", d)),
               "handoff": lambda: part_handoff(a, dev, lambda d: partial("handoff", d)),
               "grpo_step": lambda: part_grpo_step(a, dev, lambda d: partial("grpo_step", d)),
               "gap": lambda: part_gap(a, dev)}
    t_all = time.perf_counter()
    # a fixed order: megatron after the parts that need the real torch.cuda; issue 34's parts before Megatron's
    order = [*PARTS[:3], *ISSUE_34, "gap", *PARTS[3:6]]
    for name in order:
        if name not in parts:
            continue
        if name == "megatron_trainer" and "megatron" not in shared:
            result[name] = {"skipped": "no Megatron trainer (see logprobs)"}
            continue
        t0 = time.perf_counter()
        try:
            result[name] = {**runners[name](), "wall_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - a failing part is recorded; the others still run
            result[name] = {"error": error_text(e), "wall_s": time.perf_counter() - t0}
            traceback.print_exc()
        if name in ("publish", "megatron_trainer"):
            shared.pop("trainer" if name == "publish" else "megatron", None)  # free GPU memory for what follows
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{name}: {json.dumps(clean(result[name]))}", flush=True)
        if a.out:
            a.out.write_text(json.dumps(clean(result)) + "\n")
    result["wall_s"] = time.perf_counter() - t_all
    print_table(result)
    line = json.dumps(clean(result))
    if a.out:
        a.out.write_text(line + "\n")
    print(line)
    return 0


def print_table(r: dict) -> None:
    def get(part: str, key: str, fmt: str = "{:.3g}") -> str:
        v = r.get(part, {}).get(key)
        return "-" if v is None else fmt.format(v) if isinstance(v, int | float) and not isinstance(v, bool) else str(v)

    print(f"\ndevice check on {r['device']} (torch {r['torch']}, CUDA {r['cuda']}){' SMOKE' if r['smoke'] else ''}; "
          f"GPUs counted: torch {r['gpu_count']['torch']}, factory validate {r['gpu_count']['factory']}")
    rows = [("grpo steps/s: device | cpu", f"{get('grpo', 'device_steps_per_s')} | {get('grpo', 'cpu_steps_per_s')}"),
            ("grpo held-out acc: device | cpu", f"{get('grpo', 'device_accuracy')} | {get('grpo', 'cpu_accuracy')} "
                                                f"(same band: {get('grpo', 'same_band')})"),
            ("torch trainer tokens/s, MFU", f"{get('trainer', 'tokens_per_s', '{:,.0f}')}, {get('trainer', 'mfu')}"),
            ("megatron trainer tokens/s, MFU", f"{get('megatron_trainer', 'tokens_per_s', '{:,.0f}')}, "
                                               f"{get('megatron_trainer', 'mfu')}"),
            ("paged engine tokens/s (nano-vllm)", f"{get('engine', 'engine_tokens_per_s', '{:,.0f}')}, "
                                                  f"x{get('engine', 'vs_roofline')} of the decode roofline "
                                                  f"({get('engine', 'roofline_tokens_per_s', '{:,.0f}')}), peak "
                                                  f"{get('engine', 'peak_mem_gib')} GiB"),
            ("engine | generate tokens/s (subset)", f"{get('engine', 'engine_subset_tokens_per_s', '{:,.0f}')} | "
                                                    f"{get('engine', 'generate_tokens_per_s', '{:,.0f}')} "
                                                    f"(x{get('engine', 'engine_vs_generate')}, "
                                                    f"{get('engine', 'generate_seqs')} seqs)"),
            ("publish s: full | delta", f"{get('publish', 'full_s')} | {get('publish', 'delta_s')} "
                                        f"(bit-exact {get('publish', 'bit_exact')})"),
            ("torch vs megatron logprobs max|diff|", get("logprobs", "max_abs_diff")),
            ("RL batches tokens/s: today | new", f"{get('trainer_rl', 'today_tokens_per_s', '{:,.0f}')} | "
                                                 f"{get('trainer_rl', 'new_tokens_per_s', '{:,.0f}')} (MFU vs 989 "
                                                 f"TFLOP/s H100 bf16: {get('trainer_rl', 'today_mfu')} | "
                                                 f"{get('trainer_rl', 'new_mfu')})"),
            ("handoff s: in-process | shared | codec", f"{get('handoff', 'engine_update_s')} | "
                                                       f"{get('handoff', 'shared_s')} | full "
                                                       f"{get('handoff', 'codec_full_s')}, delta "
                                                       f"{get('handoff', 'codec_delta_s')}"),
            ("gap bf16 engine vs trainer bf16 | fp32", f"mean|d| {get('gap', 'peaked_bf16_mean')} | "
                                                       f"{get('gap', 'peaked_fp32_mean')}, k3 KL "
                                                       f"{get('gap', 'peaked_bf16_kl')} (peaked; init "
                                                       f"{get('gap', 'init_bf16_mean')})"),
            ("GRPO step s: today | new", f"{get('grpo_step', 'today_step_s')} | {get('grpo_step', 'new_step_s')} "
                                         f"(x{get('grpo_step', 'today_over_new')}, extrapolated: "
                                         f"{get('grpo_step', 'ratio_extrapolated')})")]
    for label, value in rows:
        print(f"  {label:<38} {value}")
    for part in PARTS:
        for key in ("error", "device_error", "cpu_error", "skipped", "shared_error", "today_error", "new_error"):
            if key in r.get(part, {}):
                print(f"  {part} {key}: {r[part][key]}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
