"""The embedded torch rollout engine: batched sampling with a KV cache, in the caller's process.

Prompts are left-padded into one batch and decoded step by step through the model's KV cache;
a sequence that emits the stop token stops contributing. This is the simple engine of the
single-machine defaults; continuous batching and the HTTP server build on it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from factory.core.rollout.base import Completion, SamplingParams


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
                 max_batch: int = 1024):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.max_batch = max_batch
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.weight_version = version

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p).input_ids for p in prompts]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        flat = [p for p in prompts for _ in range(params.n)]
        out: list[Completion] = []
        for start in range(0, len(flat), self.max_batch):
            out.extend(self._generate_batch(flat[start : start + self.max_batch], params, gen))
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        gen: torch.Generator) -> list[Completion]:
        b = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        tokens = torch.full((b, params.max_new_tokens), self.pad_id, dtype=torch.long)
        logps = torch.zeros((b, params.max_new_tokens))
        done = torch.zeros(b, dtype=torch.bool)
        lengths = torch.full((b,), params.max_new_tokens, dtype=torch.long)
        cache = None
        step_ids, step_pos = ids, pos
        for t in range(params.max_new_tokens):
            out = self.model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                             cache=cache, use_cache=True)
            cache = out.cache
            tok, lp = _sample(out.logits[:, -1, :], params, gen)
            tok = torch.where(done, torch.full_like(tok, self.pad_id), tok)
            tokens[:, t] = tok
            logps[:, t] = torch.where(done, torch.zeros_like(lp), lp)
            newly = (~done) & (tok == self.eos_id)
            lengths = torch.where(newly, torch.full_like(lengths, t + 1), lengths)
            done |= newly
            if bool(done.all()):
                break
            step_ids = tok[:, None]
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((b, 1), dtype=torch.long)], dim=1)
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
