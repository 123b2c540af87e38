"""Seeded row orders for a block-read source: which row is the i-th of epoch e, in O(1), with no index.

An epoch's order permutes the source's blocks with a bijective keyed permutation of [0, n_blocks) (a
4-round Feistel network over the next even power of two, cycle-walked back into range, so it is never
materialized) and the rows of each block with a seeded shuffle of that block alone (a block is small).
A new epoch uses a new key. The last block may be shorter than the others; wherever the block order puts
it, `locate` still maps a position to (block, slot) in constant time through the inverse permutation.

Libraries with format-preserving permutations (FF1/FF3 ciphers) need a crypto dependency and are far
slower per call; a keyed Feistel on small integers is all a shuffle needs.
"""

from __future__ import annotations

import hashlib
import random

_M64 = (1 << 64) - 1


def mix64(*parts: int) -> int:
    """A deterministic 64-bit hash of integers (splitmix64 chained over the parts)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _M64)) & _M64
        h = (h + 0x9E3779B97F4A7C15) & _M64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
        h ^= h >> 31
    return h


def name_key(name: str) -> int:
    """A stable integer for a source name (Python's str hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class FeistelPermutation:
    """A keyed bijection of [0, n), computed one element at a time (forward and inverse)."""

    ROUNDS = 4

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n, self.key = n, key
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # the domain 4**half is < 4n, so walks are short
        self.mask = (1 << self.half) - 1
        self._keys = [mix64(key, r) for r in range(self.ROUNDS)]

    def _f(self, r: int, x: int) -> int:
        return mix64(self._keys[r], x) & self.mask

    def _forward(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for r in range(self.ROUNDS):
            left, right = right, left ^ self._f(r, right)
        return (left << self.half) | right

    def _backward(self, y: int) -> int:
        left, right = y >> self.half, y & self.mask
        for r in reversed(range(self.ROUNDS)):
            left, right = right ^ self._f(r, left), left
        return (left << self.half) | right

    def __call__(self, x: int) -> int:
        if not 0 <= x < self.n:
            raise IndexError(f"{x} out of range [0, {self.n})")
        y = self._forward(x)
        while y >= self.n:  # cycle walking: a bijection of the domain restricted to [0, n) stays one
            y = self._forward(y)
        return y

    def inverse(self, y: int) -> int:
        if not 0 <= y < self.n:
            raise IndexError(f"{y} out of range [0, {self.n})")
        x = self._backward(y)
        while x >= self.n:
            x = self._backward(x)
        return x


class EpochOrder:
    """The order of one epoch of a source with `n_rows` rows read in blocks of `block_rows`.

    Position i of the epoch is slot `offset` of block `block` (`locate`), and that slot holds row
    `block * block_rows + row_perm(block)[offset]` of the source.
    """

    def __init__(self, n_rows: int, block_rows: int, key: int):
        if n_rows < 1 or block_rows < 1:
            raise ValueError(f"an epoch order needs n_rows >= 1 and block_rows >= 1, got {n_rows}, {block_rows}")
        self.n_rows, self.block_rows, self.key = n_rows, block_rows, key
        self.n_blocks = -(-n_rows // block_rows)
        self.last_len = n_rows - (self.n_blocks - 1) * block_rows
        self.blocks = FeistelPermutation(self.n_blocks, mix64(key, 1))
        self.short_at = self.blocks.inverse(self.n_blocks - 1)  # where the (maybe short) last block falls

    def block_len(self, block: int) -> int:
        return self.last_len if block == self.n_blocks - 1 else self.block_rows

    def locate(self, pos: int) -> tuple[int, int, int]:
        """(block, slot within the block, epoch position where that block starts) of epoch position `pos`."""
        if not 0 <= pos < self.n_rows:
            raise IndexError(f"position {pos} out of range [0, {self.n_rows})")
        b, short_start = self.block_rows, self.short_at * self.block_rows
        if pos < short_start:
            k, off = divmod(pos, b)
        elif pos < short_start + self.last_len:
            k, off = self.short_at, pos - short_start
        else:
            k, off = divmod(pos - self.last_len, b)
            k += 1
        return self.blocks(k), off, pos - off

    def row_perm(self, block: int) -> list[int]:
        """The seeded order of the rows inside `block` (indices relative to the block's first row)."""
        perm = list(range(self.block_len(block)))
        random.Random(mix64(self.key, 2, block)).shuffle(perm)
        return perm
