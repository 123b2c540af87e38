"""The rollout server's OpenAI log-probs: each token's true bytes, and token lists that join up to the returned text.

Token bytes: a byte-level BPE token (GPT-2, Qwen, Llama 3, SmolLM2, `factory bpe-model`) is mapped back through the
tokenizer's byte-to-unicode alphabet, so a token holding part of a UTF-8 character has its real bytes (not the
UTF-8 of a replacement character); a SentencePiece byte-fallback token `<0xNN>` is that byte; any other token is the
UTF-8 of its decoded text. Special tokens (eos, pad, role markers) have no bytes: they are never in the text.

Which tokens are listed, and as what (`TokenPieces`): the generated tokens' bytes are laid end to end and compared
with the returned text's UTF-8. A token is listed when some of its bytes are in the text; special tokens and the
tokens of a stop string (which the text excludes) are not. A token that a stop string cuts mid-token is listed with
only its bytes before the cut (its logprob is the whole token's). Each listed token's `token` string is the text of
the characters whose last byte it holds, so a token ending mid-character has `""` and the one completing it carries
the whole character: the `token` strings concatenate to exactly the text, and the `bytes` lists decode to it (bytes
that are not valid UTF-8, which a sampled sequence can hold, decode to U+FFFD as in the text).
Alternatives (top logprobs) are not in the text: each is named by its decoded text when its bytes are valid UTF-8
on their own, else `bytes:\\xe4\\xb8` (OpenAI's convention), so two tokens never share a key.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from functools import cached_property

from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(tokenizer) -> set[str]:
    """The `tokenizers` decoder types of a fast tokenizer (a Sequence's members included); empty for others."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    spec = json.loads(backend.to_str()).get("decoder") or {}
    members = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    return {m.get("type") for m in members if isinstance(m, dict)}


class TokenBytes:
    """True bytes of token ids for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        kinds = _decoder_types(tokenizer)
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    @cached_property
    def _unicode_to_byte(self) -> dict[str, int]:
        return {c: b for b, c in bytes_to_unicode().items()}

    def is_special(self, tid: int) -> bool:
        return tid in self.special

    def __call__(self, tid: int) -> bytes:
        """The bytes token `tid` adds to decoded text (b"" for a special token)."""
        if tid in self._cache:
            return self._cache[tid]
        if tid in self.special:
            out = b""
        else:
            piece = self.tokenizer.convert_ids_to_tokens(tid)
            out = None
            if self._byte_level and isinstance(piece, str) and all(c in self._unicode_to_byte for c in piece):
                out = bytes(self._unicode_to_byte[c] for c in piece)
            elif self._byte_fallback and isinstance(piece, str) and (m := _BYTE_FALLBACK.fullmatch(piece)):
                out = bytes([int(m.group(1), 16)])
            if out is None:  # added tokens, character and word-level vocabularies
                out = self.tokenizer.decode([tid]).encode()
        self._cache[tid] = out
        return out

    def name(self, tid: int) -> str:
        """How an alternative token is named: its text if its bytes are valid UTF-8 alone, else `bytes:\\x..`."""
        if tid in self.special:
            return self.tokenizer.decode([tid])
        b = self(tid)
        try:
            return b.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


@dataclass
class TokenPieces:
    """The listed tokens of one completion: their index in `token_ids`, text, bytes and character offset."""

    index: list[int]
    text: list[str]
    bytes: list[bytes]
    offset: list[int]


def token_pieces(token_bytes: TokenBytes, token_ids: list[int], text: str) -> TokenPieces:
    """The tokens of `token_ids` that make up `text` (the returned text: the decoded completion, cut before a stop
    string), each with the part of `text` and of its bytes it accounts for; see the module docstring."""
    raw = [token_bytes(t) for t in token_ids]
    if not b"".join(raw).decode(errors="replace").startswith(text):
        # A decoder that is not a plain concatenation of token bytes (e.g. one that strips or cleans up spaces):
        # fall back to what each token adds to the decoded prefix, which joins up by construction.
        raw = _incremental_bytes(token_bytes.tokenizer, token_ids, text.encode())
    # Feed the bytes one at a time to a UTF-8 decoder: a character belongs to the token whose byte completes it
    # (an invalid sequence becomes U+FFFD, as the tokenizers' lossy decoding writes it).
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    chars, cut_byte, count, pos = [], None, 0, 0  # chars completed per token; the byte offset where `text` ends
    for b in raw:
        n = 0
        for k in range(len(b)):
            n += len(decoder.decode(b[k:k + 1]))
            if cut_byte is None and count + n >= len(text):
                cut_byte = pos + k + 1
        chars.append(n)
        count += n
        pos += len(b)
    if chars:
        chars[-1] += len(decoder.decode(b"", final=True))  # a trailing partial character, replaced
    if cut_byte is None:
        cut_byte = pos
    if not text:
        cut_byte = 0
    out = TokenPieces([], [], [], [])
    c0 = start = 0
    for i, b in enumerate(raw):
        if start >= cut_byte:
            break
        c1 = c0 + chars[i]
        if b:
            out.index.append(i)
            out.text.append(text[c0:min(c1, len(text))])
            out.bytes.append(b[: cut_byte - start])
            out.offset.append(min(c0, len(text)))
        c0, start = c1, start + len(b)
    return out


def _incremental_bytes(tokenizer, token_ids: list[int], target: bytes) -> list[bytes]:
    """Per token, the bytes it adds to the decoded prefix (special tokens skipped); the last token that reaches the
    text's end takes whatever of `target` is left, so the pieces always join up to it."""
    out, done = [], b""
    for i in range(len(token_ids)):
        now = tokenizer.decode(token_ids[: i + 1], skip_special_tokens=True).encode()
        if now.endswith("\ufffd".encode()) or not now.startswith(done):  # mid-character, or not prefix-stable yet
            out.append(b"")
            continue
        out.append(now[len(done):])
        done = now
    if not b"".join(out).startswith(target):
        kept, total = [], b""
        for b in out:
            if target.startswith(total + b):
                kept.append(b)
                total += b
            else:
                kept.append(b"")
        last = max((i for i, b in enumerate(kept) if b), default=len(kept) - 1)
        if last >= 0:
            kept[last] += target[len(total):]
        out = kept
    return out
