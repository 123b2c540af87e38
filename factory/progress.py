"""Progress of a long stage (SFT, GRPO): where it is, the latest reward, and when it will end; and `Log`, where
the lines that narrate a run go.

Stages report a `Progress` to a plain callback; whoever runs them decides where it goes (a log line, run
tags in the Dagster UI, a progress bar). The ETA is the mean time per step so far times the steps left; a stage
that may stop early (SFT's `stop_at_accuracy`) shows it as an upper bound and says what ends it sooner.

Two paths for text, each for its own kind: a module's diagnostics (a retry, a restart, a lost race) go to
`logging.getLogger(__name__)`; the lines that narrate a run to its user (steps, accuracy, resume points, the
preflight gate's verdict) go to a `Log` its caller passes: `print` in the CLI, `context.log.info` in a Dagster
asset, Pipes messages from a pod. A callback and not a logger, because the destination belongs to the run and
not to the module: one process-wide handler could not send two runs' lines (a sweep's, two assets') each to
its own Dagster run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Log = Callable[[str], None]  # one line of a run's narration, for its user (see the module docstring)


@dataclass(frozen=True)
class Progress:
    phase: str  # "sft" or "grpo"
    step: int  # steps done
    steps: int  # steps planned
    elapsed_s: float
    reward: float | None = None  # latest training reward mean
    accuracy: float | None = None  # latest training-sample accuracy
    hacks: float | None = None  # latest step's completions that tripped a reward-hack detector (code verifiers)
    # The accuracy at which the stage stops before `steps` (SFT's stop_at_accuracy): `steps` is then only an
    # upper bound, and so is the ETA drawn from it.
    stops_at_accuracy: float | None = None

    @property
    def eta_s(self) -> float | None:
        if self.step >= self.steps:
            return 0.0
        if self.step <= 0:
            return None
        return self.elapsed_s / self.step * (self.steps - self.step)

    @property
    def eta(self) -> str:
        """The ETA as shown: `1m20s`; `≤ 12m00s (stops early at accuracy 0.25)` when the stage may end sooner
        than `steps` (the time left to `steps` is then only a bound); `?` before the first step."""
        eta = format_duration(self.eta_s)
        if self.stops_at_accuracy is None or self.eta_s is None or self.step >= self.steps:
            return eta
        return f"≤ {eta} (stops early at accuracy {self.stops_at_accuracy:g})"

    def line(self) -> str:
        """`grpo step 12/50 reward 0.412 eta 1m20s`"""
        parts = [f"{self.phase} step {self.step}/{self.steps}"]
        if self.reward is not None:
            parts.append(f"reward {self.reward:.3f}")
        parts.append(f"eta {self.eta}")
        return " ".join(parts)

    def tags(self) -> dict[str, str]:
        """Short string fields for run tags (the Dagster UI lists them beside a running run)."""
        out = {"progress": f"{self.phase} {self.step}/{self.steps}", "eta": self.eta}
        if self.reward is not None:
            out["reward"] = f"{self.reward:.3f}"
        if self.hacks is not None:
            out["hacks"] = f"{self.hacks:g}"
        return out


STEP_LINES = 10  # lines a stage narrates of its steps, however many it runs (a progress callback sees every step)


def narrates(step: int, steps: int, lines: int = STEP_LINES) -> bool:
    """Whether step `step` of `steps` gets a line in the run's narration: the first, every `steps // lines`-th and
    the last. A 200-step run then prints 11 step lines, not 200; the run's tags, the `steps` table and MLflow have
    every step."""
    return step == 1 or step >= steps or step % max(1, steps // lines) == 0


def format_duration(seconds: float | None) -> str:
    """`1h02m`, `3m05s`, `42s`; `?` when unknown."""
    if seconds is None:
        return "?"
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Throttle:
    """Call `fn` at most once per `every_s` seconds, plus always for the last step (`Progress.step == steps`)."""

    def __init__(self, fn: Callable[[Progress], None], every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.fn, self.every_s, self.clock = fn, every_s, clock
        self._last: float | None = None

    def __call__(self, p: Progress) -> None:
        now = self.clock()
        if self._last is None or now - self._last >= self.every_s or p.step >= p.steps:
            self._last = now
            self.fn(p)
