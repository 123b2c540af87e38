"""Helpers the assets share: the pictures and links a run shows, and progress while it runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dagster import AssetExecutionContext, MetadataValue

from factory.progress import Throttle
from factory.text import markdown_image

if TYPE_CHECKING:
    from factory.cockpit.reports import RunPictures
    from factory.cockpit.tracking import Tracker
    from factory.progress import Progress

PROGRESS_EVERY_S = 5.0  # run tags are a database write; a step every ~0.5 s would be too many


def inline_picture(alt: str, url: str) -> MetadataValue:
    """A picture the Dagster UI draws inside the metadata table: a markdown image short enough (< 1000
    characters) to be rendered in place, its bytes served by the MLflow UI at `url`."""
    return MetadataValue.md(f"![{alt}]({url})")


def embedded(pictures: dict[str, bytes]) -> MetadataValue:
    """Every picture inlined in one markdown value (data URIs): one click away ([Show Markdown]) with no
    MLflow UI running."""
    return MetadataValue.md("\n\n".join(f"**{name}**\n\n{markdown_image(png, name)}"
                                         for name, png in pictures.items()))


def run_metadata(pics: RunPictures, tracker: Tracker, run_id: str, mlflow_run_id: str
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A training run's pictures (drawn in place when the MLflow UI runs, as `make ui` starts it) and its MLflow
    link, to go first; and the pictures embedded (one click away, no MLflow UI needed), to go last."""
    from factory.cockpit.reports import CURVES, EVALS, METRICS, small  # noqa: PLC0415 heavy: mlflow, matplotlib

    where = "served by the MLflow UI; without it, open `pictures`"
    md: dict[str, Any] = {
        "curves": inline_picture(f"reward and accuracy by step of {run_id} ({where})",
                                 tracker.artifact_url(mlflow_run_id, small(CURVES))),
        # The same URL shows the latest version: periodic evals re-render it as they land.
        "evals": inline_picture(f"held-out accuracy by step of {run_id}, kept current by periodic evals ({where})",
                                tracker.artifact_url(mlflow_run_id, small(EVALS))),
        # loss, KL, entropy, gradient norm, clip fraction, staleness, response length, tokens/s, reward/accuracy, the
        # sampler/trainer gap and its corrections
        **({"metrics": inline_picture(f"metric panel by step of {run_id} ({where})",
                                      tracker.artifact_url(mlflow_run_id, small(METRICS)))}
           if pics.metrics is not None else {}),
        "run_id": run_id,
        "mlflow_run_id": MetadataValue.url(tracker.run_url(mlflow_run_id)),  # a link; the id ends it
    }
    shots = {"curves": pics.curves, **({"evals": pics.evals} if pics.evals is not None else {}),
             **({"metrics": pics.metrics} if pics.metrics is not None else {})}
    return md, {"pictures": embedded(shots)}


def progress_tags(context: AssetExecutionContext) -> Callable[[Progress], None]:
    """Reports a stage's progress as run tags (`factory/progress`, `factory/reward`, `factory/eta`), which the
    Dagster UI lists beside the run while it runs; at most every PROGRESS_EVERY_S seconds and at the end."""

    def report(p: Progress) -> None:
        context.instance.add_run_tags(context.run.run_id, {f"factory/{k}": v for k, v in p.tags().items()})

    return Throttle(report, every_s=PROGRESS_EVERY_S)
