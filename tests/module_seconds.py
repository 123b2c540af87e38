"""Writes tests/module_seconds.json, the seconds each test module took, from a pytest run with `--durations=0`:

    .venv/bin/python -m pytest -n 3 --durations=0 | .venv/bin/python tests/module_seconds.py

tests/conftest.py orders modules by it, longest first, so that `make test`'s workers start the long modules early.
A stale file only changes that order, never what runs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (?:setup|call|teardown)\s+(\S+?\.py)::")
OUT = Path(__file__).with_name("module_seconds.json")


def module_seconds(lines: list[str]) -> dict[str, float]:
    """Seconds per module (setup, call and teardown summed), longest first."""
    seconds: dict[str, float] = {}
    for line in lines:
        if m := LINE.match(line):
            seconds[m[2]] = seconds.get(m[2], 0.0) + float(m[1])
    return {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}


if __name__ == "__main__":
    seconds = module_seconds(sys.stdin.read().splitlines())
    if not seconds:
        sys.exit("no '--durations=0' lines on stdin (e.g. '12.3s call     tests/x/test_y.py::test_z')")
    OUT.write_text(json.dumps(seconds, indent=0) + "\n")
    print(f"{OUT}: {len(seconds)} modules, {sum(seconds.values()) / 60:.1f} min in all")
