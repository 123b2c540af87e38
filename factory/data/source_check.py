"""`check_sources(spec)`: what opening a spec's file sources, or reading any of their rows, would refuse, found before a
run starts (by `factory validate` and `factory run`): the path is a regular file or a directory (a FIFO, a device or
a socket is refused by stat, never opened: reading one blocks), of the kind's format, with the mapped columns, and
every row reads as a problem: each source is opened as the run opens it and read block by block (one block in
memory at a time; a JSONL line past `MAX_LINE_BYTES` is refused without being held). A whole extra pass over the
data: what the run would otherwise meet at its first epoch's last block, after its SFT and part of its RL.

Generated sources (arithmetic, suite, reasoning_gym, humaneval) are checked with the spec (factory/envs/
spec_check.py); an Iceberg source needs the lake, and is checked when the run opens it.

Relative paths: a spec loaded from a file has them made absolute against the file's folder when it is loaded
(`factory.config.load_spec`); in a spec built in Python (or one given with `--set`), a relative `path:` is relative
to the working directory of the process that opens the source, as `open_sources` reads it by default.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from factory.config import FILE_SOURCE_KINDS, ExperimentSpec
from factory.presets import PRESETS
from factory.source_spec import SourceError, parse_source_spec


def _one_line(text: str) -> str:
    return " ".join(text.split())


def check_sources(spec: ExperimentSpec, base_dir: str | Path | None = None) -> None:
    """SourceError (one line, naming the source, its file and the line) for the first file source of `spec.data`
    that opening or reading would refuse. Relative paths are under `base_dir` (default: the working directory)."""
    if spec.data is None:
        return
    fit = prompt_fit(spec)
    for i, raw in enumerate(spec.data.sources):
        if raw.get("kind") not in FILE_SOURCE_KINDS:
            continue
        try:
            check_file_source(raw, base_dir, fit)
        except SourceError as e:
            raise SourceError(f"data.sources.{i}.path: {_one_line(str(e))}") from None
        except (OSError, ValueError) as e:  # e.g. unreadable: say which source
            raise SourceError(f"data.sources.{i}.path: source {raw.get('name')!r}: {_one_line(str(e))}") from None


def prompt_fit(spec: ExperimentSpec) -> tuple[int, str] | None:
    """(the most characters a prompt may have, why) for a preset model, whose character tokenizer gives one token per
    character after `<bos>` (models/tokenizer.py), so a row's prompt is measured without a tokenizer; None for a
    `model.path` model (its tokenizer is known when it loads; the run refuses a prompt that does not fit then)."""
    if spec.model.path is not None:
        return None
    positions = spec.model.max_positions or PRESETS[spec.model.preset].max_positions
    new = spec.rollout.max_new_tokens
    return positions - new - 1, (f"with <bos> and rollout.max_new_tokens = {new} it must fit the model's {positions} "
                                 f"positions (model.max_positions); filter the source or raise model.max_positions")


def check_file_source(raw: dict[str, Any], base_dir: str | Path | None = None,
                      fit: tuple[int, str] | None = None) -> None:
    """SourceError if the file source `raw` cannot be opened or any of its rows read, or (with `fit`: the most
    characters a prompt may have, and why) a row's prompt is too long for the model."""
    from factory.data.sources import files  # noqa: PLC0415 pyarrow: file sources only; `factory validate` stays light

    s = parse_source_spec(raw)
    path = Path(s.path)
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path

    def fits(problems: list, where: Callable[[int], str]) -> None:
        for j, p in enumerate(problems if fit is not None else ()):
            if len(p.prompt) > fit[0]:
                raise SourceError(f"source {s.name!r}: {where(j)} of {str(path)!r}: its prompt has {len(p.prompt)} "
                                  f"characters, at most {fit[0]} fit: {fit[1]}")

    if not path.exists():
        raise SourceError(f"source {s.name!r}: {str(path)!r} does not exist (a {s.kind} "
                          f"{'directory' if s.kind == 'hf_disk' else 'file or directory'} was expected)")
    if s.kind == "jsonl":  # opening it reads every row; `fits` sees each block as it goes
        files.JsonlSource(s.name, path, s.verifier, s.columns, block_rows=s.block_rows,
                          on_block=lambda problems, lines: fits(problems, lambda j: f"line {lines[j]}"))
        return
    src: Any
    if s.kind == "parquet":
        if not path.is_dir():
            files.check_regular(s.name, path, "kind: parquet expects a .parquet file or a directory of them")
            if not _has_parquet_magic(path):
                raise SourceError(f"source {s.name!r}: {str(path)!r} is not a Parquet file (no PAR1 magic bytes); "
                                  f"kind: parquet expects a .parquet file or a directory of them")
        src = files.ParquetSource(s.name, path, s.verifier, s.columns, block_rows=s.block_rows)
    else:
        src = files.HFDiskSource(s.name, path, s.verifier, s.columns, split=s.split, block_rows=s.block_rows)
    for block in range(-(-len(src) // s.block_rows)):
        first = block * s.block_rows
        fits(src.read_block(block), lambda j, first=first: f"row {first + j}")


def _has_parquet_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
        if len(head) < 4:
            return False
        f.seek(-4, 2)
        return head == b"PAR1" and f.read(4) == b"PAR1"
