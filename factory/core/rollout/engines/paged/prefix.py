"""The paged engine's prefix cache: which page holds the K/V of which token prefix, so a request whose prompt starts
like an earlier one (the next turn of a multi-turn episode, a shared system prompt) reuses its pages.

A full page is named by a digest chained over the pages before it (blake2b of the previous page's digest and this
page's token ids, 16 bytes), so a digest stands for the whole prefix up to the page's end, as in nano-vllm. A page
keeps its digest after its last sequence frees it, until the block manager hands it out again (`evict`).

K/V depend on the weights: after a weight update the cached pages are another policy's, so `flush` forgets them
all and starts a new generation; sequences admitted before it stop registering pages.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def chain(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of a page holding `tokens` after the prefix whose digest is `previous` (b"" for the first)."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Digest -> page, and each page's digest while it is cached."""

    def __init__(self, num_pages: int):
        self.generation = 0
        self._page: dict[bytes, int] = {}
        self._digest: list[bytes | None] = [None] * num_pages

    def __len__(self) -> int:
        return len(self._page)

    def lookup(self, digest: bytes) -> int | None:
        return self._page.get(digest)

    def digest(self, page: int) -> bytes | None:
        return self._digest[page]

    def register(self, page: int, digest: bytes) -> None:
        """`page` now holds the prefix `digest` names (a page already cached under it stays the one found)."""
        if digest not in self._page and self._digest[page] is None:
            self._page[digest] = page
            self._digest[page] = digest

    def evict(self, page: int) -> None:
        """`page` is about to hold something else."""
        if (d := self._digest[page]) is not None:
            del self._page[d]
            self._digest[page] = None

    def flush(self) -> None:
        """Forget every page (the weights changed)."""
        self._page.clear()
        self._digest = [None] * len(self._digest)
        self.generation += 1
