"""The embedded torch rollout engine: batched sampling with a KV cache, in the caller's process.

Prompts are left-padded into one batch and decoded step by step through the model's KV cache;
a sequence that emits the stop token stops contributing. This is the simple engine of the
single-machine defaults; continuous batching and the HTTP server build on it.

Device: the engine computes where its model is (`model_device`, looked up at every call, so a model the trainer
moves in place is followed): inputs, masks, the KV cache and the sampling generator are made there, and the
results come back as host lists. A decode step waits on the device once (is every sequence done?); tokens and
logprobs come back in one copy at the end. On a GPU, `precision="bf16"` decodes under bf16 autocast (fp32 master
weights); on the CPU decoding is always fp32, so CPU numbers do not depend on it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.core.rollout.base import Completion, SamplingParams
from factory.infra.device import autocast, model_device
from factory.infra.liveness import pulse
from factory.models.compat import cache_kwargs, returned_cache


def decode_autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for a `precision: bf16` run's rollouts on a GPU; nothing on the CPU (fp32 as always)."""
    return autocast(device, precision if device.type == "cuda" else "fp32")


def _sample(logits: Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Pick next tokens; return them with their logprob under the temperature-scaled distribution."""
    if params.greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p  # always keeps the top token
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)



class EmbeddedEngine:
    """Samples from a torch model it holds; `load_weights` swaps in a new published version."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, weight_version: int = 0,
                 max_batch: int = 1024, precision: str = "fp32"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.max_batch = max_batch
        self.precision = precision  # "bf16": autocast on a GPU (see the module docstring)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.weight_version = version

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p).input_ids for p in prompts]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        device = model_device(self.model)
        gen = torch.Generator(device=device).manual_seed(params.seed if params.seed is not None else 0)
        flat = [p for p in prompts for _ in range(params.n)]
        out: list[Completion] = []
        for start in range(0, len(flat), self.max_batch):
            out.extend(self._generate_batch(flat[start : start + self.max_batch], params, gen, device))
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        gen: torch.Generator, device: torch.device) -> list[Completion]:
        b = len(prompts)
        width = max(len(p) for p in prompts)
        # Left-padded on the host as lists, then one copy each to the device.
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long,
                           device=device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long,
                            device=device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        tokens = torch.full((b, params.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((b, params.max_new_tokens), device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        lengths = torch.full((b,), params.max_new_tokens, dtype=torch.long, device=device)
        one = torch.ones((b, 1), dtype=torch.long, device=device)
        cache = None
        step_ids, step_pos = ids, pos
        for t in range(params.max_new_tokens):
            with decode_autocast(device, self.precision):
                out = self.model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                                 use_cache=True, **cache_kwargs(self.model, cache))
            cache = returned_cache(self.model, out)
            pulse()  # a long eval or rollout is alive while it decodes (infra/liveness.py)
            tok, lp = _sample(out.logits[:, -1, :], params, gen)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            tokens[:, t] = tok
            logps[:, t] = torch.where(done, torch.zeros_like(lp), lp)
            newly = (~done) & (tok == self.eos_id)
            lengths = torch.where(newly, torch.full_like(lengths, t + 1), lengths)
            done |= newly
            if bool(done.all()):  # the step's one wait on the device
                break
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, one], dim=1)
        tokens, logps, lengths = tokens.cpu(), logps.cpu(), lengths.cpu()  # no-ops on the CPU
        completions = []
        for i in range(b):
            n = int(lengths[i])
            toks = tokens[i, :n].tolist()
            stopped = bool(toks) and toks[-1] == self.eos_id
            completions.append(Completion(
                prompt_ids=list(prompts[i]),
                token_ids=toks,
                logprobs=logps[i, :n].tolist(),
                text=self.tokenizer.decode(toks, skip_special_tokens=True),
                finish_reason="stop" if stopped else "length",
                weight_version=self.weight_version,
                token_versions=[self.weight_version] * n,
            ))
        return completions
