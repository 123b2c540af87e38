"""Tiny random-init models of the paged runner's architectures (seed 0, fp32), their references, a word-level
tokenizer over their 128 ids and a paged engine sized in pages, shared by the paged runner's and engine's tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from factory.core.rollout.engines.kv_budget import kv_bytes_per_token
from factory.core.rollout.engines.paged.engine import PagedEngine

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY),
    "qwen2": lambda: Qwen2Config(**TINY),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
}
PAGE = 4  # small pages, so prompts and completions cross page boundaries often
ATOL = 1e-5
EOS = 127


def tiny(arch: str, **overrides):
    config = CONFIGS[arch]()
    # at the default 0.02 a tiny random model repeats one token whatever it reads; at 0.2 its greedy path depends on
    # its context, so a runner that reads the wrong K/V generates something else
    config.initializer_range = 0.2
    for k, v in overrides.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model


def prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]


def generate(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()


def perturbed(arch: str):
    """`tiny(arch)` with other weights (seed 1): a policy update's target."""
    model = tiny(arch)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One word per id (`t0` .. `t127`), EOS `t127`, pad `t0`."""
    vocab = {f"t{i}": i for i in range(128)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   eos_token=f"t{EOS}", pad_token="t0")


def paged_engine(model, tok, pages: int = 64, dtype: torch.dtype = torch.float32, **kw) -> PagedEngine:
    """A `PagedEngine` of `PAGE`-token pages whose KV budget is `pages` pages (the scratch page among them)."""
    return PagedEngine(model, tok, page_size=PAGE, kv_budget=pages * PAGE * kv_bytes_per_token(model.config, dtype),
                       **kw)


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens
