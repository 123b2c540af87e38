"""The task-neutral unit of work: a `Problem` (one prompt, its reference answer, and what family and level it
belongs to) and `Splits`, a task's disjoint train and held-out problems.

Every task family (arithmetic, word problems, code, a file or Iceberg source) produces `Problem`s; the data
layer blends them, the core samples and scores them, the lake records them. The field names and `to_dict()`
output are part of recorded data (split fingerprints, lake rows, JSONL files), so they do not change.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer.

    `op` names the task family or operation the problem belongs to (an arithmetic operation such as "add",
    or "word" / "code" for the text tasks); `digits` is its difficulty level (an arithmetic problem's operand
    length; 0 for the shipped text tasks). `meta` holds what a verifier needs beyond the answer (e.g. a code
    problem's unit tests, a source row's `source` and `verifier`); it does not take part in equality.
    """

    id: str
    prompt: str
    answer: str
    op: str
    digits: int
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Splits:
    """A task's training problems and its held-out problems (disjoint)."""

    train: list[Problem]
    eval: list[Problem]

    def fingerprint(self) -> str:
        """A short hash of every problem's content, in order: equal fingerprints mean equal splits."""
        h = hashlib.sha256()
        for p in self.train + self.eval:
            h.update(json.dumps(p.to_dict(), sort_keys=True).encode())
        return h.hexdigest()[:16]
