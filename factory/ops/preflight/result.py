"""What a preflight produces: one `CheckResult` per check, a `PreflightReport` per run, and their text forms."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome. `value` was held to `threshold` (a floor or a ceiling, said by `expected`)."""

    name: str
    passed: bool
    value: float | None = None
    threshold: float | None = None
    unit: str = ""
    expected: str = ""  # e.g. ">= 40 GFLOP/s", "importable", "0 uncorrected errors"
    message: str = ""
    duration_s: float = 0.0

    def line(self) -> str:
        """One line naming the check, its value, its threshold, its unit and what happened."""
        return (f"{self.name}: value {_num(self.value)}, threshold {_num(self.threshold)}"
                f"{' ' + self.unit if self.unit else ''}: {self.message}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("value", "threshold"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = None
        return d


@dataclass
class PreflightReport:
    """One preflight run on one node: its checks share `preflight_id` and `started_at` (the lake key's time)."""

    preflight_id: str
    node: str
    kind: str
    mode: str
    started_at: dt.datetime
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    recorded: bool = False
    record_error: str = ""  # why the results could not be written to the lake, if they could not

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.results)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def rows(self) -> list[dict[str, Any]]:
        """The `node_health` rows of this run: one per check."""
        return [{"node": self.node, "check": r.name, "value": r.value, "expected": r.expected or None,
                 "passed": r.passed, "recorded_at": self.started_at, "preflight_id": self.preflight_id,
                 "mode": self.mode, "threshold": r.threshold, "unit": r.unit or None,
                 "duration_s": round(r.duration_s, 4), "message": r.message or None} for r in self.results]

    def to_dict(self) -> dict[str, Any]:
        return {"preflight_id": self.preflight_id, "node": self.node, "kind": self.kind, "mode": self.mode,
                "started_at": self.started_at.isoformat(), "seconds": round(self.seconds, 3),
                "passed": self.passed, "failed": [r.name for r in self.failed], "recorded": self.recorded,
                "record_error": self.record_error or None, "checks": [r.to_dict() for r in self.results]}


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4g}" if abs(v) >= 1e-3 else f"{v:.3g}"


def format_checks(results: Sequence[CheckResult]) -> str:
    """An aligned table of every check: status, value, threshold, unit, seconds, message."""
    head = ("check", "status", "value", "threshold", "unit", "seconds", "message")
    rows = [(r.name, "ok" if r.passed else "FAIL", _num(r.value), _num(r.threshold), r.unit,
             f"{r.duration_s:.2f}", r.message) for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    numeric = {2, 3, 5}

    def fmt(row: Sequence[str]) -> str:
        cells = [str(c).rjust(w) if i in numeric else str(c).ljust(w)
                 for i, (c, w) in enumerate(zip(row[:-1], widths[:-1], strict=True))]
        return "  ".join([*cells, str(row[-1])]).rstrip()

    return "\n".join([fmt(head), *(fmt(r) for r in rows)])
