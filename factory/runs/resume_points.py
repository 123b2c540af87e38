"""When an attempt takes resume points, and how it stops on a signal: the training loop's `Checkpoints` for a run.

Resume points go to the run directory's `resume/` (`runs/attempt.py`), written in the background by a
`ResumeWriter` (`core/resume.py`); `saves.jsonl` beside it logs one line per resume point written.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from factory.config import ExperimentSpec
from factory.core.resume import ResumeWriter, TrainState
from factory.runs.attempt import StopRequest, resume_dir

SAVES = "saves.jsonl"  # one line per resume point written: its step, the trainer's stall, the write time


class RunCheckpoints:
    """The loop's `Checkpoints` for a run: resume points every `ops.resume_every` and every
    `schedule.checkpoint_every` steps, written in the background by a `ResumeWriter`; `stopping()` is the cause of
    the run's `StopRequest` (SIGTERM/SIGINT ask it: see `signals`), and the loop then saves, stops after its current
    step and returns that cause."""

    def __init__(self, spec: ExperimentSpec, run_dir: Path, before_write: Callable[[int], None] | None = None,
                 before_save: Callable[[], object] | None = None, stop: StopRequest | None = None):
        """`before_write(step)` runs in the writer's thread before a point is written; `before_save()` in the
        loop's thread before a point is taken (what the loop reported so far is covered by it); `stop` is the run's
        (a new one if not given)."""
        self.before_save = before_save
        self.every = [n for n in (spec.ops.resume_every, spec.schedule.checkpoint_every) if n]
        self.writer = ResumeWriter(resume_dir(run_dir), spec.ops.keep_resume, before_write=before_write,
                                   log_path=run_dir / SAVES)
        self.stop = stop if stop is not None else StopRequest()

    def due(self, steps_done: int) -> bool:
        return any(steps_done % n == 0 for n in self.every)

    def stopping(self) -> str | None:
        return self.stop.cause

    def save(self, make_state: Callable[[], TrainState], wait: bool = False) -> None:
        if self.before_save is not None:
            self.before_save()
        self.writer.submit(make_state, wait=wait)

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """SIGTERM / SIGINT ask the loop to save and stop after its current step (a second SIGINT
        interrupts at once). Only in the main thread, where Python delivers signals."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: object) -> None:
            if self.stop and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop.ask(StopRequest.SIGNAL)

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)
