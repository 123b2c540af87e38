"""Sources that need no file: one arithmetic level generated from a seed, and the shipped suites.

`ArithmeticSource` is one operation at one operand length. Row i is problem number `perm(start + i)` of
that level's problem space, where `perm` is a seeded bijection of the space (a Feistel network with cycle
walking), so rows are distinct, look random, and any block is computed on demand from (seed, block) in
time proportional to the block: a source of a million rows holds nothing in memory. Two sources with the
same seed and disjoint [start, start + n) ranges share no problem (a training source and its held-out set).

`SuiteSource` is a shipped set of `factory/envs/tasks.py` (word problems, code) in file order, built with the
task family's own row format so its verifier scores it exactly as in a single-task run.
"""

from __future__ import annotations

import hashlib
import json
import math
from importlib import resources

from factory.envs.arithmetic import OPS, _problem, arithmetic_capacity
from factory.envs.tasks import _SETS, _records
from factory.problem import Problem
from factory.source_spec import SourceError

from .rows import _make_problem, check_verifier

_ROUNDS = 4


def _check_block(name: str, block: int, n_blocks: int) -> None:
    if not 0 <= block < n_blocks:
        raise IndexError(f"source {name!r}: block {block} out of range (0..{n_blocks - 1})")


class _Permutation:
    """A seeded bijection of range(size): a balanced Feistel network over the smallest even number of bits that
    covers `size`, walked until the value falls inside (fewer than 4 steps on average)."""

    def __init__(self, size: int, key: bytes):
        self.size = size
        bits = max(2, math.ceil(math.log2(max(size, 2))))
        bits += bits % 2
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        digest = hashlib.sha256(key).digest()
        self.keys = [int.from_bytes(digest[4 * r:4 * r + 4], "little") & self.mask for r in range(_ROUNDS)]

    def __call__(self, i: int) -> int:
        half, mask, shift, keys = self.half, self.mask, self.half // 2 + 1, self.keys
        x = i
        while True:
            left, right = x >> half, x & mask
            for k in keys:  # the round function inlined: this loop is most of a generated block's cost
                f = ((right ^ k) * 0x9E3779B1 + k) & mask
                left, right = right, left ^ (f ^ (f >> shift))
            x = (left << half) | right
            if x < self.size:
                return x


class ArithmeticSource:
    """`n` distinct problems of one arithmetic level (operation `op`, operands of `digits` digits)."""

    def __init__(self, name: str, op: str, digits: int, n: int, seed: int = 0, start: int = 0,
                 reverse_answer: bool = True, reverse_operands: bool = False, block_rows: int = 1024,
                 verifier: str = "arithmetic"):
        if op not in OPS:
            raise SourceError(f"source {name!r}: op must be one of {', '.join(OPS)}, got {op!r}")
        if not 1 <= digits <= 18:
            raise SourceError(f"source {name!r}: digits must be 1..18, got {digits}")
        space = arithmetic_capacity([op], [digits])
        if n < 1 or start < 0 or start + n > space:
            raise SourceError(f"source {name!r}: rows [start, start + n) = [{start}, {start + n}) must lie within the "
                              f"{space} distinct {op} problems of {digits} digits (and n >= 1)")
        if block_rows < 1:
            raise SourceError(f"source {name!r}: block_rows must be >= 1, got {block_rows}")
        check_verifier(name, verifier)
        self.name, self.op, self.digits, self.n, self.seed, self.start = name, op, digits, n, seed, start
        self.reverse_answer, self.reverse_operands = reverse_answer, reverse_operands
        self.block_rows, self.verifier = block_rows, verifier
        self._operands = 10 if digits == 1 else 9 * 10 ** (digits - 1)
        self._low = 0 if digits == 1 else 10 ** (digits - 1)
        # The key leaves out start and n: sources of one level and seed share a permutation, so their ranges are
        # disjoint sets of problems.
        self._perm = _Permutation(space, f"arithmetic-source/{seed}/{op}/{digits}".encode())

    def __len__(self) -> int:
        return self.n

    def version(self) -> str:
        params = {"kind": "arithmetic", "op": self.op, "digits": self.digits, "n": self.n, "seed": self.seed,
                  "start": self.start, "reverse_answer": self.reverse_answer,
                  "reverse_operands": self.reverse_operands, "format": 1}
        return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]

    def _operands_of(self, x: int) -> tuple[int, int]:
        if self.op == "sub":  # unordered pairs: x indexes the triangle i >= j
            i = (math.isqrt(8 * x + 1) - 1) // 2
            return self._low + i, self._low + x - i * (i + 1) // 2
        return self._low + x // self._operands, self._low + x % self._operands

    def read_block(self, block: int) -> list[Problem]:
        _check_block(self.name, block, -(-self.n // self.block_rows))
        first = block * self.block_rows
        out = []
        for i in range(first, min(first + self.block_rows, self.n)):
            a, b = self._operands_of(self._perm(self.start + i))
            p = _problem(a, self.op, b, self.digits, self.reverse_answer, self.reverse_operands)
            out.append(_make_problem(p.id, p.prompt, p.answer, p.op, p.digits,
                                     {"source": self.name, "verifier": self.verifier}))
        return out


class SuiteSource:
    """A shipped set ("word_problems" or "code") in file order; its verifier is the task family of that name."""

    def __init__(self, name: str, suite: str, block_rows: int = 128):
        if suite not in _SETS:
            raise SourceError(f"source {name!r}: suite must be one of {', '.join(_SETS)}, got {suite!r}")
        if block_rows < 1:
            raise SourceError(f"source {name!r}: block_rows must be >= 1, got {block_rows}")
        self.name, self.suite, self.block_rows = name, suite, block_rows
        self._file, self._make = _SETS[suite]
        self._n = len(_records(self._file))  # a few hundred rows, cached by tasks.py

    def __len__(self) -> int:
        return self._n

    def version(self) -> str:
        data = resources.files("factory.envs").joinpath("suites", f"{self._file}.jsonl").read_bytes()
        return hashlib.sha256(data).hexdigest()[:16]

    def read_block(self, block: int) -> list[Problem]:
        _check_block(self.name, block, -(-self._n // self.block_rows))
        out = []
        for r in _records(self._file)[block * self.block_rows:(block + 1) * self.block_rows]:
            p = self._make(r)
            out.append(Problem(p.id, p.prompt, p.answer, p.op, p.digits,
                               meta={**p.meta, "source": self.name, "verifier": self.suite}))
        return out
