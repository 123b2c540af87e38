"""The step-0 gate: the rollout engine and the trainer compared on a fixed probe before a run trains on anything.

A few of the task's prompts, each as one user message, are sampled by the run's own engine through its producer
(`SyncProducer`, `OverlappedProducer`, `SGLangProducer`: the producer's tokenizer renders the chat and its engine
samples; `ServerProducer`: the rollout server's chat endpoint renders with the server's own tokenizer and template and
returns the prompt ids it used). Three checks, each naming its likely cause:

- prompt ids: the ids the engine conditioned on must equal the trainer's rendering of the same message
  (`models/prompting.prompt_ids`, the path training prompts take): else a chat template / tokenizer mismatch;
- eos: a completion that finished on a stop must end on the trainer's eos token, and none may hold that token
  before its end: else an eos mismatch (the engine stops on another token, or not on the trainer's);
- log-prob gap: the mean |engine log-prob - trainer log-prob| of the same completion tokens (the trainer's
  `logprobs` of the packed completions, as the loop's probe measures it) against `ops.logprob_gap_bound`: else
  dtype / weights (a gap spread over every token) or the attention kernel / positions (a few tokens far off).

Past any of them, `LogprobGapError` (exit code 8, `runs/exit_codes.py`) with the figures, the bound and the cause. The
loop raises the same class when the gap stays past the bound for `ops.max_gap_steps` steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from factory.config import RolloutSpec
from factory.core.batch import pack
from factory.core.correction import gap_stats
from factory.core.producers.server import ServerProducer
from factory.core.rollout.base import Completion, SamplingParams
from factory.core.rollout.server.chat import ChatTemplate
from factory.models.prompting import prompt_ids

PROBE_PROMPTS = 3  # the task's first training prompts, each one user message
PROBE_SAMPLES = 4  # completions per prompt
PROBE_MAX_NEW_TOKENS = 16  # at most; the run's rollout.max_new_tokens when shorter
PROBE_SEED = 0x6A7E  # fixed: the same probe every run of a spec
# A gap is "concentrated" (a few tokens far off) when the largest TOP_SHARE of its tokens carry at least
# CONCENTRATED of the summed |gap|; rounding spreads it over the tokens instead (measured on the quickstart's model,
# fresh and SFT-trained, engine weights rounded to fp16 or bf16: 0.12-0.45; docs/results.md).
TOP_SHARE = 0.05
CONCENTRATED = 0.8

TEMPLATE_CAUSE = "chat template / tokenizer mismatch"
EOS_CAUSE = "eos mismatch"
GAP_CAUSE_SPREAD = "dtype / weights"
GAP_CAUSE_CONCENTRATED = "attention kernel / positions"


class LogprobGapError(RuntimeError):
    """The rollout engine's log-probs and the trainer's disagree past `ops.max_logprob_gap` (or the engine renders
    prompts or stops otherwise than the trainer): a setup to fix, not a fault a restart cures (exit code 8).

    `figures`: what was measured (JSON-ready); `bound`: the gap's bound; `cause`: the likely cause, in words. The
    step-0 gate builds it with `GateResult.error`; the loop's during-run stop passes its own message."""

    def __init__(self, message: str, figures: dict[str, Any], bound: float, cause: str):
        super().__init__(message)
        self.figures, self.bound, self.cause = figures, bound, cause


@dataclass
class GateResult:
    """What the gate measured: `problems` (cause, detail) are what failed; none: the gate passed."""

    engine: str  # the producer's class: which engine path was probed
    bound: float
    figures: dict[str, Any]
    problems: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def cause(self) -> str:
        return "; ".join(dict.fromkeys(c for c, _ in self.problems))

    def summary(self) -> str:
        f = self.figures
        return (f"{self.engine}: {f['prompts']} prompts x {f['samples']} completions, {f['tokens']} tokens: "
                f"mean |gap| {_g(f['gap_abs_mean'])} (bound {_g(self.bound)}), max {_g(f['gap_abs_max'])}, "
                f"k3 KL {_g(f['gap_kl'])}; {self.seconds:.2f} s")

    def error(self) -> LogprobGapError:
        lines = [f"the rollout engine and the trainer disagree at step 0 ({self.summary()}):"]
        lines += [f"  {cause}: {detail}" for cause, detail in self.problems]
        hint = "Fix the setup (docs/recovery.md, 'The log-prob gate')"
        if any(c in (GAP_CAUSE_SPREAD, GAP_CAUSE_CONCENTRATED) for c, _ in self.problems):
            hint += "; if the gap is expected (e.g. an engine serving in bf16), raise ops.max_logprob_gap"
        lines.append(hint + ".")
        return LogprobGapError("\n".join(lines), self.figures, self.bound, self.cause)


def check_engine(rollout: RolloutSpec, trainer, producer, tokenizer: PreTrainedTokenizerBase,
                 prompts: Sequence[str], bound: float) -> GateResult:
    """Sample the probe through `producer`'s engine (at `rollout`'s temperature and top_p) and compare it with
    `trainer` (see the module docstring). `prompts`: the task's prompt texts (the first `PROBE_PROMPTS` are used);
    `bound`: the gap's bound (the run's: `spec.resolved.logprob_gap_bound` on its device). Returns the result;
    raises nothing."""
    t0 = time.perf_counter()
    texts = list(prompts)[:PROBE_PROMPTS]
    if not texts:
        raise ValueError("the log-prob gate needs at least one prompt (the task's training split is empty)")
    params = SamplingParams(n=PROBE_SAMPLES, temperature=rollout.temperature, top_p=rollout.top_p,
                            max_new_tokens=min(rollout.max_new_tokens, PROBE_MAX_NEW_TOKENS), seed=PROBE_SEED)
    messages = [[{"role": "user", "content": t}] for t in texts]
    # Torch's RNG forked: a gated run draws the same numbers as before the gate existed (resumes stay bit-identical).
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        groups = _sample(producer, messages, params)
    problems = _prompt_problems([prompt_ids(tokenizer, t) for t in texts], groups)
    comps = [c for g in groups for c in g]
    problems += _eos_problems(comps, tokenizer)
    batch = pack([c.prompt_ids for c in comps], [c.token_ids for c in comps], tokenizer.pad_token_id,
                 {"old_logprobs": [c.logprobs for c in comps]})
    trainer_lp = trainer.logprobs(batch)
    figures = gap_figures(trainer_lp, batch.per_token["old_logprobs"], batch.loss_mask)
    figures.update(prompts=len(texts), samples=params.n, max_new_tokens=params.max_new_tokens,
                   prompt_mismatches=sum(1 for c, _ in problems if c == TEMPLATE_CAUSE),
                   eos_problems=sum(1 for c, _ in problems if c == EOS_CAUSE))
    mean = figures["gap_abs_mean"]
    if mean is not None and not mean <= bound:  # NaN fails too
        cause, how = gap_cause(figures)
        problems.append((cause, f"mean |engine - trainer log-prob| {_g(mean)} > ops.max_logprob_gap {_g(bound)} "
                                f"(max {_g(figures['gap_abs_max'])}, k3 KL {_g(figures['gap_kl'])}, "
                                f"{figures['tokens']} tokens); {how}"))
    return GateResult(type(producer).__name__, bound, figures, problems, time.perf_counter() - t0)


def gate(rollout: RolloutSpec, trainer, producer, tokenizer: PreTrainedTokenizerBase,
         prompts: Sequence[str], bound: float) -> GateResult:
    """`check_engine`, raising its `LogprobGapError` when a check failed; the result when all passed."""
    result = check_engine(rollout, trainer, producer, tokenizer, prompts, bound)
    if not result.passed:
        raise result.error()
    return result


def gap_figures(trainer_lp: torch.Tensor, engine_lp: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, Any]:
    """The gap's statistics as the loop records them (`correction.gap_stats`: mean and max |trainer - engine|
    log-prob, the k3 estimate of KL(engine || trainer), ...) over the tokens on `mask` (default: all), their count,
    and the share of the summed gap its largest `TOP_SHARE` of tokens carry (None where there is no token)."""
    mask = torch.ones_like(trainer_lp, dtype=torch.bool) if mask is None else mask.bool()
    rows = torch.atleast_2d  # flat per-token values: one row
    stats = gap_stats(rows(trainer_lp), rows(engine_lp), rows(mask))
    gap = (trainer_lp.double() - engine_lp.double())[mask].abs()
    n, total = int(gap.numel()), float(gap.sum())
    top = torch.topk(gap, max(1, math.ceil(TOP_SHARE * n))).values if n else gap
    return {"tokens": n, **stats, "top_share": None if n == 0 else float(top.sum()) / total if total > 0 else 0.0}


def gap_cause(figures: dict[str, Any]) -> tuple[str, str]:
    """The likely cause of a gap past its bound, from how it spreads over the tokens (`gap_figures`), and why."""
    share = figures["top_share"]
    if share is not None and share >= CONCENTRATED:
        return GAP_CAUSE_CONCENTRATED, (f"the largest {TOP_SHARE:.0%} of tokens carry {share:.0%} of it: a few tokens "
                                        "far off, as a kernel, mask or position error at some positions gives")
    return GAP_CAUSE_SPREAD, (f"spread over the tokens (the largest {TOP_SHARE:.0%} carry {_pct(share)}), as another "
                              "dtype or rounded/other weights give")


def _sample(producer, messages: list[list[dict[str, str]]], params: SamplingParams) -> list[list[Completion]]:
    """The probe's completions per prompt, each with the prompt ids the engine conditioned on."""
    if isinstance(producer, ServerProducer):  # the server renders the chat itself: ask its chat endpoint
        return [_chat(producer, m, params, i) for i, m in enumerate(messages)]
    template = ChatTemplate(producer.tok)  # in-process engines and SGLang: the producer renders, the engine samples
    return producer.engine.generate([template.render(m, generation_prompt=True) for m in messages], params)


def _chat(producer: ServerProducer, messages: list[dict[str, str]], params: SamplingParams,
          index: int) -> list[Completion]:
    # Through the producer's supervised client: a server that crashes is restarted (and counted by its breaker)
    # as for any rollout request.
    out = producer.post("/v1/chat/completions", {
        "messages": messages, "n": params.n, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
        "top_p": params.top_p, "seed": params.seed + index})
    return [Completion(prompt_ids=c["prompt_token_ids"], token_ids=c["token_ids"], logprobs=c["token_logprobs"],
                       text=c["message"].get("content") or "", finish_reason="length" if c["finish_reason"] ==
                       "length" else "stop", weight_version=c["weight_version"]) for c in out["choices"]]


def _prompt_problems(trainer_ids: list[list[int]], groups: list[list[Completion]]) -> list[tuple[str, str]]:
    out = []
    for i, (want, group) in enumerate(zip(trainer_ids, groups, strict=True)):
        got = group[0].prompt_ids
        if list(got) == list(want):
            continue
        at = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        out.append((TEMPLATE_CAUSE,
                    f"probe prompt {i + 1}: the engine conditioned on {len(got)} ids, the trainer renders {len(want)}; "
                    f"first difference at position {at} (engine {_at(got, at)}, trainer {_at(want, at)})"))
    return out


def _eos_problems(comps: list[Completion], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, str]]:
    eos = tokenizer.eos_token_id
    wrong_end = [c for c in comps if c.finish_reason == "stop" and (not c.token_ids or c.token_ids[-1] != eos)]
    past_eos = [c for c in comps if eos in c.token_ids[:-1]]
    out = []
    if wrong_end:
        ends = sorted({c.token_ids[-1] for c in wrong_end if c.token_ids})
        out.append((EOS_CAUSE, f"{len(wrong_end)} of {len(comps)} completions stopped on token(s) {ends}, not the "
                               f"trainer's eos {eos} ({tokenizer.convert_ids_to_tokens(eos)!r}): the engine stops on "
                               "another eos"))
    if past_eos:
        out.append((EOS_CAUSE, f"{len(past_eos)} of {len(comps)} completions hold the trainer's eos {eos} "
                               f"({tokenizer.convert_ids_to_tokens(eos)!r}) before their end: the engine does not "
                               "stop on it"))
    return out


def _at(ids: Sequence[int], k: int) -> str:
    return str(ids[k]) if k < len(ids) else "end"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
