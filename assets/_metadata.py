"""Reading an upstream asset's latest materialization metadata (how assets hand each other paths)."""

from __future__ import annotations

from typing import Any

from dagster import AssetExecutionContext, AssetKey, Failure


def upstream(context: AssetExecutionContext, key: str) -> dict[str, Any]:
    """Metadata values of `key`'s latest materialization; fails clearly if it was never built."""
    event = context.instance.get_latest_materialization_event(AssetKey(key))
    if event is None or event.asset_materialization is None:
        raise Failure(f"upstream asset {key!r} has no materialization yet; materialize it first")
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}
