"""How a task's prompt and answer become token ids for the policy's tokenizer: the one rule SFT, rollouts, evals
and the prompt-length checks share.

A tokenizer with a chat template (a `model.path` model's, e.g. ChatML for Qwen) gets the prompt as one user
message rendered with the generation prompt, the way the rollout server's chat endpoint renders it, so a model
trained here answers the same text the same way when it is served. A tokenizer without one (the presets'
character tokenizers) encodes the bare prompt. An answer ends with the tokenizer's eos token, which is what the
engines stop on: for a chat model it must be its end-of-turn token (`<|im_end|>` for ChatML).
"""

from __future__ import annotations

from collections.abc import Mapping

from transformers import PreTrainedTokenizerBase


def uses_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The token ids the policy sees for a task prompt (see the module docstring)."""
    if not uses_chat_template(tokenizer):
        return list(tokenizer(text).input_ids)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def answer_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The completion a demonstration teaches: the answer's tokens, then eos (the end of the reply)."""
    return list(tokenizer(text, add_special_tokens=False).input_ids) + [tokenizer.eos_token_id]
