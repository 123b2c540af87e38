"""Rollout throughput: SGLang servers vs Factory's embedded continuous-batching engine, same prompts, same sampling.

Workload: `--prompts` prompts of random token ids (lengths uniform in [--min-prompt, --max-prompt], seeded),
one completion each, temperature 1, top_p 1, exactly `--max-new` new tokens (`ignore_eos`: random weights would
stop at random places, and equal lengths make the two engines' token counts equal). The model is a randomly
initialised Qwen2-0.5B-shaped Qwen2 (no download, no tokenizer: prompts are ids, SGLang runs with
--skip-tokenizer-init, and the embedded engine gets a stand-in tokenizer that only names eos/pad and writes ids as
text). tokens/s = generated tokens / wall seconds of the whole call, measured after one small warm-up call.

- sglang: `SGLangServers` (from `--sglang-python`, bf16, `--mem-fraction` of the GPU) behind `SGLangRouter`; all
  prompts in one /generate call per server (SGLang schedules its own continuous batches);
- embedded: `ContinuousEngine` (`factory/core/rollout/engines/continuous.py`) with `--embedded-batch` slots, driven
  in-process. It is CPU-only as written (it builds its index and sampling tensors on the CPU and samples with CPU
  generators; there is no device argument), so it runs on this machine's CPU cores (`--threads`) in
  `--embedded-dtype`, while SGLang runs on the GPU. The ratio is therefore "Factory's CPU engine vs SGLang on an
  H100", not two engines on one device.

On one H100 (sglang in its own venv):

    python benchmarks/gpu/sglang_vs_embedded.py --sglang-python /opt/sglang-venv/bin/python --threads 16

`--smoke`: the `micro` shape on CPU, the fake SGLang server (tests/core/fake_sglang_server.py: deterministic
tokens, no model): the code path ran, the numbers mean nothing (the fake's tokens also stop early at its EOS).

What was NOT run in this repository's sessions: any real SGLang server, any GPU (none was lent); only --smoke.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import random_model, sglang_python, sglang_spec, smoke_note  # noqa: E402

from factory.core.rollout.base import SamplingParams  # noqa: E402
from factory.core.rollout.engines.continuous import ContinuousEngine  # noqa: E402
from factory.core.sglang.router import SGLangRouter  # noqa: E402
from factory.core.sglang.servers import SGLangServers  # noqa: E402

EOS, PAD = 2, 0


class IdTokenizer:
    """What `ContinuousEngine` needs of a tokenizer here: eos/pad ids, and decode (ids written as text)."""

    eos_token_id, pad_token_id = EOS, PAD

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def timed(generate, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = generate(prompts, params)
    wall = time.perf_counter() - t0
    return wall, sum(len(c.token_ids) for g in out for c in g)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="micro shape, CPU, fake SGLang server")
    ap.add_argument("--sglang-python", default=None, help="python of sglang's venv (default: $SGLANG_PYTHON)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 64; smoke 8)")
    ap.add_argument("--min-prompt", type=int, default=None, help="shortest prompt in tokens (default 32; smoke 4)")
    ap.add_argument("--max-prompt", type=int, default=None, help="longest prompt in tokens (default 256; smoke 12)")
    ap.add_argument("--max-new", type=int, default=None, help="new tokens per completion (default 128; smoke 8)")
    ap.add_argument("--embedded-batch", type=int, default=64, help="ContinuousEngine slots")
    ap.add_argument("--embedded-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads for the embedded engine "
                                                              "(default: the cores here; smoke 1)")
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument("--sglang-arg", action="append", default=[], help="more sglang.launch_server arguments")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    d = (8, 4, 12, 8) if a.smoke else (64, 32, 256, 128)
    n, lo, hi, max_new = a.prompts or d[0], a.min_prompt or d[1], a.max_prompt or d[2], a.max_new or d[3]
    threads = a.threads or (1 if a.smoke else len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    shape = "micro" if a.smoke else "qwen2-0.5b"
    model = random_model(shape, seed=a.seed, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1)
    vocab = model.config.vocab_size
    if hi + max_new > model.config.max_position_embeddings:
        ap.error(f"--max-prompt + --max-new = {hi + max_new} exceeds the model's context "
                 f"{model.config.max_position_embeddings}")
    prompts = workload(n, lo, hi, vocab, a.seed)
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=max_new, ignore_eos=True, seed=a.seed)
    warm = SamplingParams(n=1, temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=a.seed)
    work = Path(tempfile.mkdtemp(prefix="gpu-sglang-vs-embedded-"))
    model.save_pretrained(work / "model", safe_serialization=True)

    spec = sglang_spec(smoke=a.smoke, workdir=work, servers=1, python=sglang_python(a.sglang_python),
                       mem_fraction=a.mem_fraction, fake_vocab=vocab,
                       extra_args=["--skip-tokenizer-init", "--dtype", "bfloat16", *a.sglang_arg])
    t0 = time.perf_counter()
    servers = SGLangServers(spec, work / "model", work / "logs").start()
    startup = time.perf_counter() - t0
    print(f"sglang up in {startup:.1f}s at {servers.urls} (logs {work / 'logs'})", flush=True)
    try:
        with SGLangRouter(servers.urls, None, servers=servers, max_batch=max(n, 1)) as router:
            timed(router.generate, prompts[:2], warm)
            sg_wall, sg_tokens = timed(router.generate, prompts, params)
    finally:
        servers.stop()
    print(f"sglang: {sg_tokens} tokens in {sg_wall:.2f}s", flush=True)

    dtype = getattr(torch, a.embedded_dtype)
    engine = ContinuousEngine(model.to(dtype), IdTokenizer(), max_batch=a.embedded_batch,  # type: ignore[arg-type]
                              max_seq_len=hi + max_new)
    with torch.inference_mode():
        timed(engine.generate, prompts[:2], warm)
        em_wall, em_tokens = timed(engine.generate, prompts, params)
    print(f"embedded: {em_tokens} tokens in {em_wall:.2f}s", flush=True)

    sg_tps, em_tps = sg_tokens / sg_wall, em_tokens / em_wall
    note = smoke_note(a.smoke)
    print()
    if note:
        print(note)
    print(f"{'engine':>9} {'device':>22} {'tokens':>8} {'wall s':>8} {'tokens/s':>10}")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ("fake server" if a.smoke else "gpu")
    print(f"{'sglang':>9} {gpu[:22]:>22} {sg_tokens:8d} {sg_wall:8.2f} {sg_tps:10,.0f}")
    print(f"{'embedded':>9} {f'cpu x{threads} {a.embedded_dtype}':>22} {em_tokens:8d} {em_wall:8.2f} {em_tps:10,.0f}")
    print(f"{n} prompts of {lo}-{hi} tokens, {max_new} new tokens each (ignore_eos), temperature 1; model {shape}; "
          f"sglang / embedded = {sg_tps / em_tps:.2f}x")
    print(json.dumps({
        "model": shape, "prompts": n, "max_new_tokens": max_new, "sglang_tokens_per_s": round(sg_tps, 1),
        "embedded_tokens_per_s": round(em_tps, 1), "sglang_vs_embedded": round(sg_tps / em_tps, 3),
        "sglang_tokens": sg_tokens, "embedded_tokens": em_tokens, "sglang_startup_s": round(startup, 1),
        "sglang_device": gpu, "embedded_device": f"cpu x{threads} {a.embedded_dtype}", "smoke": a.smoke,
        "note": note,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
