"""Training assets that survive their own failures: a retry resumes the run instead of starting it over.

A training asset's factory run_id is derived from the Dagster run's root run id, so every retry of the same
materialization (an op retry in the same run, or a run retry/re-execution, which keeps the root) names the
same factory run, and `run_rl` continues it from its newest resume point. Failures that retrying cannot
fix (non-finite losses, a service whose circuit breaker tripped, a node that failed preflight, a rollout engine whose
log-probs disagree with the trainer's) are raised
as `Failure(allow_retries=False)`: they need a person first.

A run worker that dies outright (kill -9, OOM) takes no step process with it: Dagster's multiprocess executor
runs each step in a child process, which the kernel hands to another parent. `watched_by_run_worker` makes the
trainer in such a step treat the run worker as its supervisor (`runs/attempt.py` `supervisor_lost`): once the
worker is gone it saves a resume point after its current step and stops, instead of training on as an orphan
that Terminate cannot reach; the run retry (`TRAINING_TAGS`) resumes it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dagster import AssetExecutionContext, Backoff, Failure, RetryPolicy

from factory.infra.supervisor import CircuitOpen
from factory.runs.attempt import SUPERVISOR_ENV, AttemptLock
from factory.runs.exit_codes import EXIT_SUPERVISOR_LOST
from resources.run_launcher import worker_pid

# Two automatic retries, a few seconds apart (a crashed service or a killed process is usually back by then).
TRAINING_RETRY = RetryPolicy(max_retries=2, delay=2, backoff=Backoff.EXPONENTIAL)
# Run-level retries, for a run worker that died outright (kill -9, OOM): the code server or run monitoring marks
# the run failed and the instance's run retries (factory/ops/instance.py, deploy/) re-execute it from the failed
# step; the root run id, and so the factory run, stay the same. A step that failed on its own is left to its
# RetryPolicy, or to a person when it needs a fix: whatever the instance's retry_on_asset_or_op_failure says
# (the Helm chart cannot set it).
TRAINING_TAGS = {"dagster/max_retries": "2", "dagster/retry_strategy": "FROM_FAILURE",
                 "dagster/retry_on_asset_or_op_failure": "false"}


def factory_run_id(context: AssetExecutionContext, name: str) -> str:
    """The factory run this materialization trains: the same for all its retries."""
    root = context.run.root_run_id or context.run.run_id
    return f"{name}-{root[:8]}"


@contextlib.contextmanager
def no_retry_for_what_needs_a_fix() -> Iterator[None]:
    from factory.core.gate import LogprobGapError  # noqa: PLC0415 heavy: torch, transformers; when the step runs
    from factory.core.loop import NonFiniteLoss  # noqa: PLC0415 heavy: torch; when the step runs

    try:
        yield
    except (NonFiniteLoss, CircuitOpen, LogprobGapError) as e:
        raise Failure(description=f"{type(e).__name__}: {e}", allow_retries=False) from e


# What an orphaned step may take, once it failed, to record that and exit: Dagster's multiprocess executor sends its
# events to the dead worker through a pipe that nobody reads any more, and at exit Python waits for that pipe to
# take them all (seen: an orphan blocked in a pipe write for good after its step ended).
ORPHAN_EXIT_S = 30.0


def _exit_soon(after_s: float) -> None:
    """End this process `after_s` seconds from now if it is still here (the step's failure is in the instance's
    event log by then: Dagster writes it there before it queues it for the worker)."""
    timer = threading.Timer(after_s, os._exit, args=(EXIT_SUPERVISOR_LOST,))
    timer.daemon = True
    timer.start()


def run_worker_parent(context: AssetExecutionContext) -> int | None:
    """The pid of this run's worker when this step runs in a child process of it (the multiprocess executor on
    this machine), else None: the step runs in the worker itself, in a pod, or in a test's process."""
    found = worker_pid(context.instance, context.run.run_id)
    if found is None or found[0] != os.getppid():
        return None
    return found[0]


@contextlib.contextmanager
def watched_by_run_worker(context: AssetExecutionContext) -> Iterator[int | None]:
    """Training inside this block stops at a resume point if the run worker dies (see the module docstring):
    the worker is the supervisor of the attempt here, and of a `factory train-grpo` child (its grandparent). What
    ends the block once the worker is gone leaves as a Failure that says so, not retried here (nothing is left to
    act on a retry request): the run's own retry resumes the run. Yields the worker's pid, or None where there is
    no worker process to watch (the block runs unwatched)."""
    pid = run_worker_parent(context)
    if pid is None:
        yield None
        return
    before = os.environ.get(SUPERVISOR_ENV)
    os.environ[SUPERVISOR_ENV] = str(pid)
    try:
        yield pid
    except Exception as e:
        if os.getppid() == pid:
            raise  # the worker lives: whatever stopped training says so itself
        _exit_soon(ORPHAN_EXIT_S)
        raise Failure(description=f"the run worker (pid {pid}) is gone: training stopped at a resume point "
                      f"({type(e).__name__}: {e}); the run's retry resumes it", allow_retries=False) from e
    finally:
        if before is None:
            os.environ.pop(SUPERVISOR_ENV, None)
        else:
            os.environ[SUPERVISOR_ENV] = before


def wait_for_previous_attempt(run_dir: Path, timeout_s: float, log: Callable[[str], None],
                              poll_s: float = 0.5) -> bool:
    """Before a retry trains: wait up to `timeout_s` for a live earlier attempt of the run (the orphaned trainer of a
    run worker that died, stopping at its next step) to release the run's lock. True once it is free; False after
    the timeout, and the run then refuses to start, naming the lock."""
    if not AttemptLock.is_held(run_dir):
        return True
    log(f"an earlier attempt of this run still holds {run_dir / 'attempt.lock'} (the trainer of a run worker that "
        f"died stops at its next step): waiting up to {timeout_s:g} s for it")
    deadline = time.monotonic() + timeout_s
    while AttemptLock.is_held(run_dir):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
