"""Character-level tokenizers built with `tokenizers` for a task's alphabet (no download)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ARITHMETIC_ALPHABET = "0123456789+-*="
# Printable ASCII with newline and tab: word problems and code (envs/tasks.py).
TEXT_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n\t"


def tokenizer_for(task_name: str) -> PreTrainedTokenizerFast:
    """The character tokenizer a task family needs: digits and operators for arithmetic, ASCII text otherwise."""
    return build_tokenizer(ARITHMETIC_ALPHABET if task_name == "arithmetic" else TEXT_ALPHABET)


def build_tokenizer(alphabet: str = ARITHMETIC_ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet`, plus pad/bos/eos; encoding prepends <bos>."""
    chars = sorted(set(alphabet))
    vocab = {PAD: 0, BOS: 1, EOS: 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, newlines too
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side="left"
    )
