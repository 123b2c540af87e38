"""The `PromptSource` extension point: a named, versioned collection of tasks read in blocks of rows (the data
section's source kinds implement it: factory/data/sources/; the module docstring there says how blocks are read)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from factory.problem import Problem


@runtime_checkable
class PromptSource(Protocol):
    name: str
    block_rows: int  # rows per block (the last block may be shorter)

    def __len__(self) -> int: ...

    def version(self) -> str: ...

    def read_block(self, block: int) -> list[Problem]: ...
