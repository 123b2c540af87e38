"""The rollout server's guard against costly prompts: a length bound checked before any tokenizing, and
tokenization of large prompts on worker threads instead of the serving loop.

The bound is in characters: a prompt longer than `max_seq_len * max_token_chars` characters cannot fit the context
in any tokenization, where `max_token_chars` is the longest token of the vocabulary in characters (its special
tokens' text included, e.g. `<|im_start|>`). A byte-level BPE vocabulary writes each byte as one character, so its
tokens' lengths over-count, never under-count, the text they cover; so the bound refuses only prompts that could not
run. (A tokenizer whose normalizer deletes characters, e.g. BERT's, could fit more; causal LM tokenizers keep every
character.) Prompts within the bound but larger than `inline_chars` are tokenized (and chat templates rendered) on a
small thread pool: the HF tokenizers release the GIL while encoding, so `/health` and small requests keep being
answered.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from factory.core.rollout.server.api_models import APIError

T = TypeVar("T")
INLINE_CHARS = 8192  # prompts up to this many characters are tokenized on the loop: a thread hop costs more


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` can stand for (its longest vocabulary entry; at least 1)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no character bound can be derived
        return 0
    return max((len(t) for t in vocab), default=1) or 1


class PromptGate:
    """The character bound of one engine's prompts and the pool that tokenizes the large ones."""

    def __init__(self, tokenizer: Any, max_seq_len: int, inline_chars: int = INLINE_CHARS, workers: int = 2):
        self.max_seq_len = max_seq_len
        self.token_chars = max_token_chars(tokenizer)
        # 0: unknown (no vocabulary listing): only the token count bounds the prompt, after tokenizing
        self.max_prompt_chars = max_seq_len * self.token_chars if self.token_chars else None
        self.inline_chars = inline_chars
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout-tokenize")

    def check(self, chars: int, field: str) -> None:
        """APIError (400, naming `field`) if `chars` characters cannot fit the context however they tokenize."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError(400, f"{field}: {chars} characters cannot fit this model's maximum context length of "
                                f"{self.max_seq_len} tokens (a token is at most {self.token_chars} characters: at "
                                f"most {self.max_prompt_chars} characters)", field)

    async def run(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: inline for a prompt of up to `inline_chars` characters, else on the pool (the loop keeps
        serving meanwhile); its exceptions (APIError included) propagate."""
        if chars <= self.inline_chars:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
