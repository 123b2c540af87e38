"""`check.py --parts grpo_step`: one GRPO step of the Qwen2-0.5B shape timed by phase, today's code and the new code
side by side (rl_check.py's docstring says what each side runs and how the phases are measured)."""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable

import torch
from common import random_model
from engine_check import word_tokenizer, workload
from rl_check import BUDGET_S, GRPO, GRPO_SMOKE, free, grpo_loss, shape, switches, sync

PHASES = ("generate", "score", "train", "handoff")


def generate_within(engine, prompts: list[list[int]], params, budget_s: float, dev: torch.device) -> dict:
    """Drive `engine` (not started) until every sample is done or `budget_s` passes; past it, the rest is cancelled
    and the time extrapolated from the tokens made (a decode step's cost grows with the context, so an
    extrapolation is a lower bound)."""
    n = params.n
    futures = engine.submit_many([(p, i * n + j) for i, p in enumerate(prompts) for j in range(n)], params)
    target = len(futures) * params.max_new_tokens
    before = engine.stats.generated_tokens
    sync(dev)
    t0 = time.perf_counter()
    while True:  # at least one step: an extrapolation needs tokens
        engine.step()
        if all(f.done() for f in futures) or time.perf_counter() - t0 >= budget_s:
            break
    sync(dev)
    seconds = time.perf_counter() - t0
    made = engine.stats.generated_tokens - before
    out = {"generate_s": seconds, "generated_tokens": made, "generate_extrapolated": False}
    if not all(f.done() for f in futures):
        for f in futures:
            f.cancel()
        while engine.running or engine.queued:  # the cancelled rows leave at the next steps
            engine.step()
        out.update(generate_s=seconds * target / max(made, 1), generate_measured_s=seconds,
                   generate_extrapolated=True)
        return out
    completions = [f.result() for f in futures]
    out["groups"] = [completions[i * n:(i + 1) * n] for i in range(len(prompts))]
    return out


def score(groups: list[list], group_size: int):
    """A stand-in reward (random weights: the parity of the completion's token-id sum), GRPO's group advantages,
    and the packed batch."""
    from factory.config import parse_spec
    from factory.core import algorithms
    from factory.core.batch import pack

    samples = [c for g in groups for c in g]
    rewards = torch.tensor([float(sum(c.token_ids) % 2 == 0) for c in samples], dtype=torch.float64)
    adv = algorithms.compute_advantages(parse_spec({}).algorithm, rewards, group_size,
                                        torch.tensor([len(c.token_ids) for c in samples]))
    return pack([c.prompt_ids for c in samples], [c.token_ids for c in samples], 0,
                {"old_logprobs": [c.logprobs for c in samples]}, {"advantages": adv.tolist()})


def timed(fn: Callable[[], object], dev: torch.device) -> tuple[object, float]:
    sync(dev)
    t0 = time.perf_counter()
    result = fn()
    sync(dev)
    return result, time.perf_counter() - t0


def codec_handoff_today(model, engine, prev: dict) -> dict:
    """Today's codec round as `ServerProducer` ran it: fresh fp32 host copies (a sync per tensor), a delta against
    the last version, bytes, then the receiver's host copy, apply, load. Returns the new published state."""
    from factory.core.rollout.engines.sequences import load_state_dict_into
    from factory.core.weights import WeightUpdate, apply_update, encode_delta
    from factory.infra.device import host_copy

    new = {k: host_copy(v) for k, v in model.state_dict().items()}
    wire = encode_delta(prev, new, 2, 1).to_bytes()
    current = {k: host_copy(v) for k, v in engine.model.state_dict().items()}
    load_state_dict_into(engine.model, apply_update(current, WeightUpdate.from_bytes(wire), 1))
    return new


def one_side(side: str, model, tok, prompts: list[list[int]], params, budget_s: float, batch: list | None,
             out: dict, a: argparse.Namespace, dev: torch.device) -> list | None:
    """One side's step, its phases' seconds into `out`; returns the samples scored and trained on (`batch`, or this
    side's own when none is given yet; None if there are none)."""
    from factory.core.rollout.base import SamplingParams
    from factory.core.rollout.engines.continuous import ContinuousEngine
    from factory.core.rollout.engines.paged.engine import make_engine
    from factory.core.rollout.engines.paged.serving import model_dtype
    from factory.core.trainer.torch_trainer import TorchTrainer

    rows = out["minibatch_rows"]
    trained = copy.deepcopy(model).to(dev)
    served = copy.deepcopy(model).to(dev)
    kw = dict(max_batch=len(prompts) * params.n, max_seq_len=max(map(len, prompts)) + params.max_new_tokens,
              precision="bf16")
    engine = (make_engine(served, tok, owns_model=True, **kw) if side == "new" else ContinuousEngine(served, tok, **kw))
    out[f"{side}_engine"] = f"{type(engine).__name__} ({model_dtype(engine.model)})"
    # first-call costs (allocator, kernels, CUDA graphs) before timing: two short prompts
    engine.generate(prompts[:2], SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=1))
    gen = generate_within(engine, prompts, params, budget_s, dev)
    groups = gen.pop("groups", None)
    out.update({f"{side}_{k}": v for k, v in gen.items()})
    batch = batch if batch is not None else groups
    if batch is None:
        return None
    trainer = TorchTrainer(trained, lr=1e-6, precision="bf16" if dev.type == "cuda" else "fp32",
                           **switches(side == "new", a.smoke))
    packed, out[f"{side}_score_s"] = timed(lambda: score(batch, params.n), dev)
    loss = grpo_loss()
    trainer.step(packed.select(torch.arange(min(rows, len(packed)))), loss)  # warm-up (compilation)
    minibatches = max(1, len(packed) // rows)
    _, out[f"{side}_train_s"] = timed(lambda: trainer.step(packed, loss, minibatches), dev)
    out[f"{side}_train_tokens"] = int(packed.attention_mask.sum())
    if side == "new":
        def handoff() -> None:
            fut = engine.update_weights(trained.state_dict(), 2, "in_flight")
            engine.step()
            fut.result(timeout=60)
        _, out["new_handoff_s"] = timed(handoff, dev)
    else:
        prev = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # version 1, published
        _, out["today_handoff_s"] = timed(lambda: codec_handoff_today(trained, engine, prev), dev)
    out[f"{side}_step_s"] = sum(out[f"{side}_{p}_s"] for p in PHASES)
    return batch


def part_grpo_step(a: argparse.Namespace, dev: torch.device, save: Callable[[dict], None]) -> dict:
    from factory.core.rollout.base import SamplingParams

    t_part = time.perf_counter()
    w = GRPO_SMOKE if a.smoke else GRPO
    model = random_model(shape(a), seed=0)
    vocab = model.config.vocab_size
    tok = word_tokenizer(vocab)
    prompts, _ = workload(w["prompts"], w["min_prompt"], w["max_prompt"], vocab - 2, seed=5)
    params = SamplingParams(n=w["samples"], temperature=1.0, max_new_tokens=w["new_tokens"], seed=7)
    out: dict = {"shape": shape(a), "weights": "random (rewards are a stand-in on token ids)",
                 "prompts": w["prompts"], "samples": w["samples"], "max_new_tokens": w["new_tokens"],
                 "prompt_lengths": f"uniform {w['min_prompt']}-{w['max_prompt']}",
                 "minibatch_rows": 2 if a.smoke else a.grpo_minibatch_rows,
                 "today": "ContinuousEngine, switches off, codec (fp32 delta)",
                 "new": "make_engine (paged, bf16), switches on, in-process cast-copy"}
    batch = None  # the new side's samples: both sides score and train on them
    for side in ("new", "today"):
        left = BUDGET_S["grpo_step"] - (time.perf_counter() - t_part)
        if left < 20:
            out[f"{side}_skipped"] = f"{left:.0f} s left of the part's budget"
            continue
        budget = min(w["today_budget_s"], left - 15) if side == "today" else left
        batch = one_side(side, model, tok, prompts, params, budget, batch, out, a, dev)
        save(out)
        free(dev)
        if batch is None:
            out[f"{side}_error"] = "no samples to score and train on (generation passed its budget)"
            break
    if "today_step_s" in out and "new_step_s" in out:
        out["today_over_new"] = out["today_step_s"] / out["new_step_s"]
        out["ratio_extrapolated"] = bool(out.get("today_generate_extrapolated"))
    return out
