"""check.py's `gap` part: the sampler/trainer gap of the paged engine serving in bf16 against the trainer's own
log-probs of the same tokens (issue 35), on Qwen2-0.5B's shape.

The engine (`PagedEngine(precision="bf16")`: bf16 weights, the paged decode kernel on CUDA) samples `ROWS` completions
of `OUT` tokens at temperature 1 (`ignore_eos`) from random prompts; the trainer (`TorchTrainer`) scores the same
tokens under the fp32 weights the engine's copy follows, once under bf16 autocast (the trainer's GPU precision) and
once in fp32. `core/correction.py`'s `gap_stats` gives mean and max |d|, the k3 KL(sampler || trainer), the share of
tokens outside [1/2, 2] and the p95 of |sequence log-ratio|, for each.

Two models: the random initialization (nearly uniform next-token distributions over 151,936 tokens, so a small gap
per token), and the same with the final norm's gain scaled by `PEAK`, which scales every logit, so that next-token
distributions are peaked as a trained model's are (the sampled tokens' mean log-prob is reported beside each to show
how peaked). Nothing downloads. SkyRL's CI bounds (0.0104 sync, 0.0193 fully async: mean |d| on a 1.5B model after
one epoch of GSM8K) are printed for scale, not as a pass mark. `--smoke` runs it on the CPU at tiny sizes (an fp32
engine: the gap is float noise there).
"""

from __future__ import annotations

import argparse
import time

import torch
from common import random_model
from engine_check import word_tokenizer, workload

from factory.core.batch import pack
from factory.core.correction import gap_stats
from factory.core.rollout.base import SamplingParams
from factory.core.rollout.engines.paged.engine import PagedEngine
from factory.core.trainer.torch_trainer import TorchTrainer

ROWS, OUT, PROMPT = 64, 256, (64, 512)
SMOKE = {"rows": 4, "out": 8, "prompt": (4, 12)}
PEAK = 8.0  # logit scale of the peaked variant: logits std ~0.6 at init on the 0.5B shape, ~5 scaled
SKYRL_BOUNDS = {"sync": 0.0104, "fully_async": 0.0193}


def part_gap(a: argparse.Namespace, dev: torch.device) -> dict:
    cuda = dev.type == "cuda"
    rows, out_len, (lo, hi) = (SMOKE["rows"], SMOKE["out"], SMOKE["prompt"]) if a.smoke else (ROWS, OUT, PROMPT)
    shape = "micro" if a.smoke else "qwen2-0.5b"
    result: dict = {"shape": shape, "rows": rows, "out_tokens": out_len, "skyrl_bounds": SKYRL_BOUNDS}
    for variant, scale in (("init", 1.0), ("peaked", PEAK)):
        t0 = time.perf_counter()
        model = random_model(shape, seed=0)
        with torch.no_grad():
            model.model.norm.weight.mul_(scale)  # the final norm's gain: every logit scales (the head is tied)
        model.to(dev)
        vocab = model.config.vocab_size
        prompts, _ = workload(rows, lo, hi, min(vocab - 2, 10000), seed=3)
        engine = PagedEngine(model, word_tokenizer(vocab), max_batch=rows, max_seq_len=hi + out_len + 16,
                             precision="bf16" if cuda else "fp32")
        params = [SamplingParams(temperature=1.0, max_new_tokens=out_len, ignore_eos=True, seed=i)
                  for i in range(rows)]
        done = [g[0] for g in engine.generate(prompts, params)]
        batch = pack(prompts, [c.token_ids for c in done], 0, {"old_logprobs": [c.logprobs for c in done]})
        served = next(engine.model.parameters()).dtype
        figures: dict = {"engine_dtype": str(served), "tokens": batch.n_tokens,
                         "sampled_logprob_mean": float(batch.per_token["old_logprobs"][batch.loss_mask].mean())}
        for precision in ("bf16", "fp32") if cuda else ("fp32",):
            trainer = TorchTrainer(model, lr=0.0, precision=precision)
            t1 = time.perf_counter()
            own = trainer.logprobs(batch)
            stats = gap_stats(own, batch.per_token["old_logprobs"], batch.loss_mask)
            figures[f"trainer_{precision}"] = {**stats, "score_s": time.perf_counter() - t1}
            result[f"{variant}_{precision}_mean"] = stats["gap_abs_mean"]  # flat, for check.py's table
            result[f"{variant}_{precision}_kl"] = stats["gap_kl"]
        figures["wall_s"] = time.perf_counter() - t0
        result[variant] = figures
        del engine, model, trainer
        if cuda:
            torch.cuda.empty_cache()
    return result
