"""How a training run's attempts are watched and restarted: the choice `Pipeline.train` applies (runs/pipeline.py),
named here apart from it so that the launcher resource and the CLI name it without importing the engine."""

from __future__ import annotations

from enum import StrEnum


class Supervision(StrEnum):
    """`in_process`: the run trains in the calling process; a crash ends the attempt, and whoever retries (a Dagster
    retry, `factory resume`) continues it from its newest resume point. `supervised`: each attempt is a child process
    (a torchrun group of ranks for a data-parallel spec), restarted (resuming) when it dies or hangs, up to
    `ops.max_restarts` (runs/restarts.py)."""

    IN_PROCESS = "in_process"
    SUPERVISED = "supervised"
