"""Token bytes and the tokens that join up to a returned text (`factory/core/rollout/server/logprobs.py`)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from factory.core.rollout.server.logprobs import TokenBytes, token_pieces
from factory.models.bpe import build_bpe_tokenizer
from factory.models.tokenizer import tokenizer_for

TEXT = "Café costs 5€ at 中文 🙂!"


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(seed=0)


def test_bpe_model_tokens_have_their_true_bytes_and_distinct_names(bpe):
    tb = TokenBytes(bpe)
    plain = [i for i in range(len(bpe)) if i not in bpe.all_special_ids]
    partial = [i for i in plain if not _utf8(tb(i))]
    assert len(bpe) == 512 and len(partial) == 128  # the count: tokens holding part of a UTF-8 character
    assert all(len(tb(i)) == 1 and tb(i)[0] >= 0x80 for i in partial)
    assert len({tb(i) for i in plain}) == len(plain)  # no two tokens share bytes ...
    assert len({tb.name(i) for i in range(len(bpe))}) == len(bpe)  # ... nor a name: top-logprob keys never collide
    assert tb.name(partial[0]).startswith("bytes:\\x") and tb(bpe.eos_token_id) == b""


def test_multibyte_text_joins_up_at_every_cut(bpe):
    tb = TokenBytes(bpe)
    ids = bpe(TEXT, add_special_tokens=False).input_ids + [bpe.eos_token_id]
    pieces = token_pieces(tb, ids, TEXT)
    assert "".join(pieces.text) == TEXT and b"".join(pieces.bytes).decode() == TEXT
    assert len(pieces.index) == len(ids) - 1  # the eos is not listed
    assert "" in pieces.text and "中" in pieces.text and "🙂" in pieces.text  # a character goes to its last byte
    assert pieces.offset == [len("".join(pieces.text[:i])) for i in range(len(pieces.text))]
    for cut in range(len(TEXT) + 1):  # a stop string may start anywhere, mid-token included
        part = token_pieces(tb, ids, TEXT[:cut])
        assert "".join(part.text) == TEXT[:cut] and b"".join(part.bytes).decode() == TEXT[:cut]
        assert all(b == tb(ids[i])[: len(b)] for i, b in zip(part.index, part.bytes, strict=True))
        assert all(part.bytes)  # no token is listed for nothing


def test_invalid_utf8_sampled_mid_text_joins_up_as_replacement_characters(bpe):
    tb = TokenBytes(bpe)
    lone = next(i for i in range(len(bpe)) if tb(i) == b"\xa1")  # a continuation byte with no lead byte
    ids = bpe("ab", add_special_tokens=False).input_ids + [lone] + bpe("cd", add_special_tokens=False).input_ids
    text = bpe.decode(ids, skip_special_tokens=True)
    assert text == "ab\ufffdcd"
    pieces = token_pieces(tb, ids, text)
    assert "".join(pieces.text) == text and b"".join(pieces.bytes) == b"ab\xa1cd"
    assert b"".join(pieces.bytes).decode(errors="replace") == text


def test_character_tokenizer_pieces_are_the_characters():
    tok = tokenizer_for("code")
    tb = TokenBytes(tok)
    ids = tok("x = 1\n", add_special_tokens=False).input_ids + [tok.eos_token_id]
    pieces = token_pieces(tb, ids, "x = 1\n")
    assert pieces.text == list("x = 1\n") and pieces.index == list(range(6))


def test_a_decoder_that_adds_spaces_falls_back_to_decoded_prefixes():
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}
    raw = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    ids = [1, 2, 3, 1]
    text = tok.decode(ids)
    assert text == "hello worlds hello"  # not the concatenation of the tokens' own text
    pieces = token_pieces(TokenBytes(tok), ids, text)
    assert pieces.text == ["hello", " world", "s", " hello"]
    cut = token_pieces(TokenBytes(tok), ids, "hello wor")
    assert cut.text == ["hello", " wor"] and cut.index == [0, 1]


def _utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True
