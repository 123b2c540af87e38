"""A small Hugging Face model directory with a real byte-level BPE tokenizer, built offline.

`build_bpe_model_dir` trains a byte-level BPE (the `tokenizers` library, as GPT-2/Qwen/Llama 3 use) on
text shipped with Factory (the word and code problem suites) plus generated arithmetic, with digits split
one per token (`Digits(individual_digits=True)` before `ByteLevel`, as Qwen and Llama do: multi-digit
merges would make carries unlearnable), ChatML special tokens and a ChatML chat template, and saves it with
a randomly initialised Qwen2 model sized like the `tiny` preset. Its eos token is `<|im_end|>` (the end of a
reply, as in Qwen's instruct models), so prompts rendered with the template (`models/prompting.py`) and
replies ending in eos read as ChatML conversations. Tests, examples and benchmarks use it as
the "bring your own model" directory (`model.path`) without downloading anything. Same seed, same bytes.
"""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from factory.presets import PRESETS

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
# ChatML, as Qwen's templates render it (without their default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_OPS = "+-*"


def training_text(seed: int = 0, arithmetic_lines: int = 2000) -> list[str]:
    """The BPE training corpus: the shipped word and code problems, and generated arithmetic lines."""
    suites = resources.files("factory.envs").joinpath("suites")
    lines: list[str] = []
    for name in ("word_problems", "code_problems"):
        for raw in suites.joinpath(f"{name}.jsonl").read_text().splitlines():
            if raw.strip():
                r = json.loads(raw)
                lines.extend(str(v) for k, v in r.items() if k in ("question", "answer", "prompt", "solution"))
    # The chat template's role names, often enough to merge into one token each (a prompt then costs a few tokens
    # of template, not one per letter of "assistant").
    lines.extend(f"{role}\n" for role in ("system", "user", "assistant", "tool") for _ in range(200))
    rng = random.Random(f"bpe-{seed}")
    for _ in range(arithmetic_lines):
        a, b = rng.randint(0, 999999), rng.randint(0, 999999)
        op = rng.choice(_OPS)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"{a}{op}{b}={value}")
    return lines


def build_bpe_tokenizer(seed: int = 0, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `training_text(seed)`; encoding prepends the bos token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    # A leading bos gives the first prompt token a fixed context, as Llama's tokenizers do.
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    # eos is the end of a turn, as in Qwen's instruct tokenizers: replies (SFT answers, sampled completions)
    # end with <|im_end|>, which the engines stop on and the chat template closes each message with.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=IM_END,
                                   extra_special_tokens=[IM_START, EOS], padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_bpe_model_dir(path: str | Path, seed: int = 0, vocab_size: int = 512, preset: str = "tiny",
                        max_positions: int = 128) -> Path:
    """Write a Qwen2-architecture model sized like `preset` (random init from `seed`) and its BPE tokenizer to
    `path` as a standard HF directory (config.json, model.safetensors, tokenizer.json, chat template)."""
    path = Path(path)
    tok = build_bpe_tokenizer(seed, vocab_size)
    p = PRESETS[preset]
    config = AutoConfig.for_model(
        "qwen2", vocab_size=len(tok), hidden_size=p.hidden_size, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, intermediate_size=p.intermediate_size,
        max_position_embeddings=max_positions, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=True, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
