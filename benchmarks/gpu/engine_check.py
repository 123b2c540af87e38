"""check.py's `engine` part: the paged engine on nano-vllm's benchmark workload, against transformers `generate` and
the decode roofline.

The workload (nano-vllm's bench.py): 256 sequences, prompt and output lengths each uniform in [100, 1024]
(`random.Random(0)`), prompt ids uniform in [0, 10000], temperature 0.6, every sequence runs to its output length
(`SamplingParams.ignore_eos`), all submitted at once (one `generate` call with one `SamplingParams` per prompt). The
model is Qwen2-0.5B's shape with its real 151,936-token vocabulary, random weights from the config (nothing
downloads), built in fp32 and handed to `PagedEngine(precision="bf16")`, which serves it in bf16 on CUDA.

Figures (one dict, check.py's `engine` key):
- `engine_tokens_per_s`: generated tokens / wall of the whole workload (prefill included), after a warm-up.
- `engine_vs_generate`: tokens/s of the engine over transformers `generate` on the same first `--generate-seqs`
  prompts and lengths (one left-padded batch in the engine's own bf16 model; `generate` runs every row to the
  batch's longest output, and only each row's own length counts as generated).
- `vs_roofline`: engine tokens/s over the decode roofline's: every sequence decoding from the start, decode step t
  reads the weights once plus the K/V of every live sequence at its length then, over `--bandwidth-tbs` (4.3 TB/s,
  the device-to-device copy measured on the H200s lent here: /work/.library/device/KINDS.md; datasheet 4.8).
  Prefill is left out of the roofline and in the measured wall, so the ratio is an upper bound of the decode's.
- `peak_mem_gib` (`torch.cuda.max_memory_allocated` over the workload; it includes `source_gib`, the fp32 model
  the engine's bf16 copy follows, as a trainer's would be), the engine's stats over the workload
  (whatever `EngineStats` holds: counters added later, CUDA-graph ones say, appear by themselves), `engine_kw` (the
  constructor keywords used: `cuda_graphs=True` where the constructor has it, plus `--engine-kw`).
- `--profile`: the top kernels of 50 decode steps (torch.profiler; the prompts' pages are cached first, so the
  profiled call prefills only each prompt's last page) written to `engine_profile.txt` beside `--out`.

Each phase's budget on one H200 is `BUDGET_S`; a phase whose budget no longer fits `--engine-budget-s` is skipped
with a note. The prefix cache is flushed between phases (setting `weight_version`), so no phase reuses another's
prompt pages. `--smoke` runs the same code at tiny sizes on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _p in (HERE.parents[1], HERE.parent, HERE):  # the repository, benchmarks/ and this folder, as check.py has them
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
from common import random_model  # noqa: E402
from rollout_engine import left_padded  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from factory.core.rollout.base import SamplingParams  # noqa: E402
from factory.core.rollout.engines.kv_budget import kv_bytes_per_token  # noqa: E402
from factory.core.rollout.engines.paged.engine import PagedEngine  # noqa: E402

# seconds each phase may take on one H200 at worst: 435 in all, inside the part's 480 (8 minutes)
BUDGET_S = {"build": 45, "warmup": 60, "workload": 150, "generate": 90, "engine_subset": 45, "profile": 45}
NANO = {"seqs": 256, "min_len": 100, "max_len": 1024, "max_id": 10000, "temperature": 0.6}
SMOKE = {"seqs": 8, "min_len": 4, "max_len": 24, "max_id": 500, "temperature": 0.6}
PROFILE_STEPS = 50


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--generate-seqs", type=int, default=64, help="engine part: the first N sequences run by "
                    "transformers generate (one batch) and by the engine, for engine_vs_generate (smoke: 4)")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.3, help="engine part: device memory bandwidth for "
                    "the decode roofline, TB/s (4.3: a copy measured on the lent H200s)")
    ap.add_argument("--engine-kw", type=json.loads, default={}, help="engine part: extra PagedEngine keywords, "
                    "as a JSON object")
    ap.add_argument("--engine-budget-s", type=float, default=480.0, help="engine part: skip later phases past this")
    ap.add_argument("--profile", action="store_true", help="engine part: top kernels of 50 decode steps "
                    "(torch.profiler) to engine_profile.txt beside --out")


def workload(seqs: int, min_len: int, max_len: int, max_id: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py: `seqs` prompts of random ids in [0, max_id], prompt and output lengths uniform in
    [min_len, max_len]."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_id) for _ in range(rng.randint(min_len, max_len))] for _ in range(seqs)]
    return prompts, [rng.randint(min_len, max_len) for _ in range(seqs)]


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A tokenizer of `vocab` word tokens t0 .. t{vocab-1} (t0 pads, the last is EOS): the engine decodes its
    completions with it; the benchmark's work is in token ids."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token=f"t{vocab - 1}")


def decode_roofline(prompt_lens: list[int], out_lens: list[int], weight_bytes: int, kv_per_token: int,
                    bandwidth: float) -> dict:
    """Seconds and tokens/s of the decode's memory floor when every sequence decodes from the start: the first
    token comes from the prefill; decode step t (1 .. longest output - 1) reads the weights once and the K/V of each
    sequence still running (output > t) at its length then (prompt + t positions)."""
    steps = max(out_lens) - 1
    seconds = 0.0
    for t in range(1, steps + 1):
        live = sum(p + t for p, o in zip(prompt_lens, out_lens, strict=True) if o > t)
        seconds += (weight_bytes + live * kv_per_token) / bandwidth
    return {"roofline_s": seconds, "roofline_tokens_per_s": sum(out_lens) / seconds if seconds else None,
            "roofline_steps": steps}


def engine_keywords(extra: dict, dev: torch.device) -> dict:
    """`cuda_graphs=True` on CUDA where PagedEngine takes it (another piece of issue 33 adds it), plus `extra`."""
    accepted = inspect.signature(PagedEngine.__init__).parameters
    kw = {"cuda_graphs": True} if "cuda_graphs" in accepted and dev.type == "cuda" else {}
    if bad := [k for k in extra if k not in accepted]:
        takes = sorted(k for k in accepted if k not in ("self", "model", "tokenizer"))
        raise ValueError(f"--engine-kw: PagedEngine takes no {bad}; it takes {takes}")
    return {**kw, **extra}


def stats_of(engine: PagedEngine) -> dict:
    s = engine.stats
    return dataclasses.asdict(s) if dataclasses.is_dataclass(s) else dict(vars(s))


def stats_over(before: dict, after: dict) -> dict:
    """Counters over a phase (maxima as they stand after it)."""
    return {k: v - before.get(k, 0) if isinstance(v, int | float) and not isinstance(v, bool)
            and not k.startswith("max") else v for k, v in after.items()}


def flush(engine: PagedEngine) -> None:
    engine.weight_version = engine.weight_version  # a new weight generation: the prefix cache forgets its pages


def timed(fn: Callable[[], object], dev: torch.device) -> tuple[object, float]:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return out, time.perf_counter() - t0


def params_for(lengths: list[int], temperature: float) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_new_tokens=m, ignore_eos=True, seed=i)
            for i, m in enumerate(lengths)]


@torch.no_grad()
def run_generate(model, prompts: list[list[int]], lengths: list[int], temperature: float, pad: int) -> int:
    """transformers `generate`, one left-padded batch run to the longest output; returns the tokens the workload
    asks for (each row's own length)."""
    device = next(model.parameters()).device
    ids, attn = left_padded(prompts, pad)
    longest = max(lengths)
    out = model.generate(ids.to(device), attention_mask=attn.to(device), do_sample=True, temperature=temperature,
                         top_p=1.0, top_k=0, max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad)
    if out.shape[1] - ids.shape[1] != longest:
        raise RuntimeError(f"generate stopped after {out.shape[1] - ids.shape[1]} of {longest} tokens")
    return sum(lengths)


def profile_decode(engine: PagedEngine, prompts: list[list[int]], steps: int, path: Path, dev: torch.device) -> dict:
    """The top kernels of `steps` decode steps over `prompts` (their pages cached by a 1-token call first)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    flush(engine)
    engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=1))  # names the prompts' full pages
    params = SamplingParams(temperature=0.6, max_new_tokens=steps + 1, ignore_eos=True, seed=0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    before = stats_of(engine)
    with profile(activities=activities) as prof, record_function(f"{steps}_decode_steps"):  # the call, labelled
        engine.generate(prompts, params)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    ran = stats_over(before, stats_of(engine))
    events = prof.key_averages()
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by=key, row_limit=30)
    path.write_text(f"{len(prompts)} sequences, {ran.get('steps')} decode steps and {ran.get('prefills')} prefill(s) "
                    f"of {ran.get('prefill_tokens')} tokens (each prompt's last page), sorted by {key}\n\n"
                    f"{table}\n")
    label = f"{steps}_decode_steps"
    top = sorted((e for e in events if e.key != label), key=lambda e: getattr(e, key), reverse=True)[:5]
    return {"profile_file": str(path), "profile_decode_steps": ran.get("steps"),
            "profile_top": [[e.key[:80], round(getattr(e, key) / 1e3, 3)] for e in top]}  # ms


def part_engine(a: argparse.Namespace, dev: torch.device, save: Callable[[dict], None]) -> dict:
    t_part = time.perf_counter()
    w = SMOKE if a.smoke else NANO
    shape = "micro" if a.smoke else "qwen2-0.5b"
    out: dict = {"shape": shape, "workload": "nano-vllm bench", "seqs": w["seqs"], "budget_s": BUDGET_S}

    def fits(*phases: str) -> bool:
        left = a.engine_budget_s - (time.perf_counter() - t_part)
        if left >= sum(BUDGET_S[p] for p in phases):
            return True
        out[f"skipped_{'_'.join(phases)}"] = f"{left:.0f} s left of --engine-budget-s, the phase's budget is more"
        return False

    t0 = time.perf_counter()
    prompts, lengths = workload(w["seqs"], w["min_len"], w["max_len"], w["max_id"])
    model = random_model(shape, seed=0).to(dev)
    vocab = model.config.vocab_size
    tok = word_tokenizer(vocab)
    kw = engine_keywords(a.engine_kw, dev)
    eng = PagedEngine(model, tok, max_batch=w["seqs"], max_seq_len=2 * w["max_len"], precision="bf16", **kw)
    served = eng.model
    dtype = next(served.parameters()).dtype
    weight_bytes = sum(p.numel() * p.element_size() for p in served.parameters())
    source = 0 if eng.source is None else sum(p.numel() * p.element_size() for p in eng.source.parameters())
    out.update(vocab=vocab, engine_kw=kw, weights_dtype=str(dtype), served_from_copy=eng.source is not None,
               weights_gib=weight_bytes / 2**30, source_gib=source / 2**30, kv_store_gib=eng.store.nbytes / 2**30,
               prompt_tokens=sum(map(len, prompts)), generated_target=sum(lengths), build_s=time.perf_counter() - t0)
    del model  # the engine keeps what it serves (and its source, if it made a bf16 copy)

    t0 = time.perf_counter()  # first-call costs (allocator, kernels, graph capture) paid before timing
    warm, _ = workload(min(8, w["seqs"]), min(16, w["min_len"]), min(48, w["max_len"]), w["max_id"], seed=1)
    eng.generate(warm, params_for([8] * len(warm), w["temperature"]))
    run_generate(served, warm[:2], [4, 4], w["temperature"], tok.pad_token_id)
    out["warmup_s"] = time.perf_counter() - t0
    save(out)

    flush(eng)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    before = stats_of(eng)
    done, wall = timed(lambda: eng.generate(prompts, params_for(lengths, w["temperature"])), dev)
    generated = sum(len(g[0].token_ids) for g in done)
    roof = decode_roofline(list(map(len, prompts)), lengths, weight_bytes, kv_bytes_per_token(served.config, dtype),
                           a.bandwidth_tbs * 1e12)
    out.update(engine_tokens_per_s=generated / wall, workload_s=wall, generated_tokens=generated,
               all_full_length=all(len(g[0].token_ids) == m for g, m in zip(done, lengths, strict=True)),
               peak_mem_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
               engine_stats=stats_over(before, stats_of(eng)), bandwidth_tbs=a.bandwidth_tbs, **roof)
    out["vs_roofline"] = out["engine_tokens_per_s"] / roof["roofline_tokens_per_s"]
    save(out)

    n = min(4 if a.smoke else a.generate_seqs, w["seqs"])
    if fits("generate", "engine_subset"):
        sub, sub_len = prompts[:n], lengths[:n]
        torch.manual_seed(0)
        tokens, wall = timed(lambda: run_generate(served, sub, sub_len, w["temperature"], tok.pad_token_id), dev)
        out.update(generate_seqs=n, generate_tokens_per_s=tokens / wall, generate_s=wall)
        flush(eng)
        done, wall = timed(lambda: eng.generate(sub, params_for(sub_len, w["temperature"])), dev)
        out["engine_subset_tokens_per_s"] = sum(len(g[0].token_ids) for g in done) / wall
        out["engine_vs_generate"] = out["engine_subset_tokens_per_s"] / out["generate_tokens_per_s"]
        save(out)

    if a.profile and fits("profile"):
        steps = 5 if a.smoke else PROFILE_STEPS
        path = (a.out.parent if a.out else Path.cwd()) / "engine_profile.txt"
        out.update(profile_decode(eng, prompts, steps, path, dev))
    return out
