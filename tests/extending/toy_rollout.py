"""A toy rollout backend, written as a third party would, outside `factory/` and through the public API only
(`factory.protocols`): an engine that samples one token at a time with a full forward pass (no KV cache: slow,
short, exact), made a backend by `engine_backend`. docs/extending.md ("Adding a rollout backend") walks through it.

Every completion it hands out is appended to the JSON-lines file `$TOY_ROLLOUT_LOG` (when set), with the weight
version it was sampled under, and every publish likewise: the test reads them back to show that the run trained
on the toy's completions."""

from __future__ import annotations

import copy
import json
import os
import threading

import torch

from factory.protocols import Completion, SamplingParams
from factory.protocols.producer import engine_backend


class ToyEngine:
    """The `RolloutEngine` protocol: `generate` and `load_weights`, and the `weight_version` it samples under."""

    def __init__(self, model: torch.nn.Module, tokenizer, weight_version: int):
        self.model = copy.deepcopy(model).eval()  # its own copy: the trainer steps its weights only by publishing
        self.tok, self.weight_version = tokenizer, weight_version
        self._lock = threading.Lock()  # the overlapped modes call generate from several producer threads

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        with self._lock:
            out = [[self._sample(ids, params, j) for j in range(params.n)] for ids in prompts]
        _log({"completions": [c.text for group in out for c in group], "version": self.weight_version})
        return out

    def _sample(self, prompt_ids: list[int], params: SamplingParams, j: int) -> Completion:
        gen = torch.Generator().manual_seed((params.seed or 0) * 1009 + j)
        ids, tokens, logprobs = list(prompt_ids), [], []
        finish = "length"
        for _ in range(params.max_new_tokens):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits / params.temperature, dim=-1)  # what the trainer's log-probs measure
            token = int(lp.argmax()) if params.greedy else int(torch.multinomial(lp.exp(), 1, generator=gen))
            ids.append(token)
            tokens.append(token)
            logprobs.append(float(lp[token]))
            if token == self.tok.eos_token_id:
                finish = "stop"
                break
        return Completion(prompt_ids=list(prompt_ids), token_ids=tokens, logprobs=logprobs,
                          text=self.tok.decode(tokens, skip_special_tokens=True), finish_reason=finish,
                          weight_version=self.weight_version, token_versions=[self.weight_version] * len(tokens))

    def load_weights(self, state_dict: dict, version: int) -> None:
        with self._lock:
            self.model.load_state_dict(state_dict)
            self.weight_version = version
        _log({"published": version})


def _log(entry: dict) -> None:
    path = os.environ.get("TOY_ROLLOUT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


# The backend: the spec names it `rollout.engine: tests.extending.toy_rollout:build` (an import path), or
# `PRODUCERS.register("toy", build)` names it `toy` in this process.
build = engine_backend(lambda spec, model, tokenizer, version: ToyEngine(model, tokenizer, version))
