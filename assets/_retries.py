"""Training assets that survive their own failures: a retry resumes the run instead of starting it over.

A training asset's factory run_id is derived from the Dagster run's root run id, so every retry of the same
materialization (an op retry in the same run, or a run retry/re-execution, which keeps the root) names the
same factory run, and `run_rl` continues it from its newest resume point. Failures that retrying cannot
fix (non-finite losses, a service whose circuit breaker tripped, a node that failed preflight) are raised
as `Failure(allow_retries=False)`: they need a person first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dagster import AssetExecutionContext, Backoff, Failure, RetryPolicy

from factory.infra.supervisor import CircuitOpen

# Two automatic retries, a few seconds apart (a crashed service or a killed process is usually back by then).
TRAINING_RETRY = RetryPolicy(max_retries=2, delay=2, backoff=Backoff.EXPONENTIAL)
# Run-level retries, for a run worker that died outright (kill -9, OOM): the instance's run monitoring notices
# and re-executes; the root run id, and so the factory run, stay the same.
TRAINING_TAGS = {"dagster/max_retries": "2", "dagster/retry_strategy": "FROM_FAILURE"}


def factory_run_id(context: AssetExecutionContext, name: str) -> str:
    """The factory run this materialization trains: the same for all its retries."""
    root = context.run.root_run_id or context.run.run_id
    return f"{name}-{root[:8]}"


@contextlib.contextmanager
def no_retry_for_what_needs_a_fix() -> Iterator[None]:
    from factory.core.loop import NonFiniteLoss  # heavy: torch, transformers, when the step runs

    try:
        yield
    except (NonFiniteLoss, CircuitOpen) as e:
        raise Failure(description=f"{type(e).__name__}: {e}", allow_retries=False) from e
