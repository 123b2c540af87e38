"""A run's HF-format checkpoints: saved at a step, published to the object store when one is set (beside training,
through `models/uploads.py`, when the run gives its uploads), and recorded in the `checkpoints` table."""

from __future__ import annotations

from factory.home import FactoryPaths
from factory.lake.writer import Lake
from factory.models.checkpoint import CheckpointInfo, recorded_uri, save_checkpoint
from factory.models.checkpoint_store import checkpoint_store_uri
from factory.models.uploads import BackgroundUploads
from factory.runs.degraded import disk_guard
from factory.runs.recovery import now as _now


def record_checkpoint(model, tok, paths: FactoryPaths, lake: Lake, run_id: str, step: int,
                      final: bool = False, uploads: BackgroundUploads | None = None) -> CheckpointInfo:
    """Save an HF-format checkpoint of the run at `step` and record it (periodic evals pick it up). With
    $FACTORY_CHECKPOINT_URI set it is also published to that object store, and its URI there is what is recorded:
    with `uploads`, beside training (recorded once it is there, from the upload thread), else before returning."""
    name = "final" if final else f"step-{step:06d}"
    where = paths.checkpoints / run_id / name
    with disk_guard("checkpoint_write", where):  # a full disk: "disk full: <run dir>", not a SafetensorError
        info = save_checkpoint(model, tok, where, meta={"kind": "rl", "run_id": run_id, "step": step})

    def record(uri: str) -> None:
        row = dict(run_id=run_id, step=step, kind="rl", uri=uri, bytes=info.bytes, sha256=info.sha256,
                   recorded_at=_now())
        if uploads is None:
            lake.upsert("checkpoints", [row])
        else:  # the upload thread: its own Lake (a Lake is used by one thread)
            with Lake.open(paths) as own:
                own.upsert("checkpoints", [row])

    store = checkpoint_store_uri()
    if uploads is not None and store is not None:
        uploads.submit(info.path, store, f"{run_id}/{name}", info.sha256, on_done=record)
    else:
        record(recorded_uri(info, f"{run_id}/{name}"))
    return info
