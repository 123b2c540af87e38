"""The prompt-source interface: a named, versioned collection of tasks read in blocks of rows.

A source holds `len(source)` rows in a fixed order and hands them out a block at a time (`read_block(b)`
returns rows [b * block_rows, (b + 1) * block_rows)), so a reader never needs the whole source in memory
and a shuffling reader (the blender) can permute blocks and rows within a block without an index of the
whole source. Each row is a `Problem` (factory/problem.py): id, prompt, answer, op, digits, and
`meta` with at least `source` (the source's name) and `verifier` (what scores it: a task family name such
as "arithmetic", "word_problems", "code", or an environment import path).

`version()` is a content hash or an Iceberg snapshot id: equal versions mean equal rows in equal order.
"""

from __future__ import annotations

from factory.problem import Problem
from factory.protocols.source import PromptSource


def num_blocks(source: PromptSource) -> int:
    return -(-len(source) // source.block_rows)


class ListSource:
    """A source over rows already in memory (small sets, tests)."""

    def __init__(self, name: str, rows: list[Problem], version: str, block_rows: int = 1024):
        if block_rows < 1:
            raise ValueError(f"source {name!r}: block_rows must be >= 1, got {block_rows}")
        self.name, self.rows, self._version, self.block_rows = name, rows, version, block_rows

    def __len__(self) -> int:
        return len(self.rows)

    def version(self) -> str:
        return self._version

    def read_block(self, block: int) -> list[Problem]:
        if not 0 <= block < num_blocks(self):
            raise IndexError(f"source {self.name!r}: block {block} out of range (0..{num_blocks(self) - 1})")
        return self.rows[block * self.block_rows:(block + 1) * self.block_rows]
