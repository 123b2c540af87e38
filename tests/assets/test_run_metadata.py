"""assets/_metadata.py run_metadata with factory/cockpit/reports.py run_pictures: what a run's asset page shows, from a
real lake (step rows as the trainer writes them) and a real MLflow store: the metric panel drawn in place (served by
the MLflow UI) and embedded, beside the curves; and links into MLflow that open its training view."""

from __future__ import annotations

import re
import struct
import urllib.parse
from pathlib import Path

from assets._metadata import run_metadata
from factory.cockpit.reports import METRICS, run_pictures, small
from factory.cockpit.tracking import WORKFLOW_QUERY, Tracker
from factory.runs.step_rows import StepLog
from tests.cockpit.test_metric_panel import GENERATED, RUN, _step

ROOT = Path(__file__).parents[2]


def test_a_runs_page_draws_its_metric_panel_in_place_and_embedded(factory_home, lake, tmp_path):
    log = StepLog(RUN, attempt=1)
    for step, lengths in enumerate(GENERATED):
        log.add(_step(step, lengths))
    log.flush(lake)
    tracker = Tracker(factory_home)
    mlflow_run_id = tracker.start_run("panel", RUN)

    pics = run_pictures(lake, tracker, RUN, mlflow_run_id)
    head, tail = run_metadata(pics, tracker, RUN, mlflow_run_id)

    # (the evals picture is linked before any eval: periodic evals render it at that URL as they land)
    assert list(head) == ["curves", "evals", "metrics", "run_id", "mlflow_run_id"]
    panel = head["metrics"].value
    assert panel.startswith(f"![metric panel by step of {RUN} (")
    assert f"/get-artifact?path={urllib.parse.quote(small(METRICS), safe='')}&run_uuid={mlflow_run_id}" in panel
    assert len(panel) < 1000  # short enough for the Dagster UI to draw it in place
    embedded = tail["pictures"].value
    assert "**metrics**" in embedded and embedded.count("data:image/png;base64,") == 2  # curves and the panel
    # stored on the run's MLflow run at full size (1000 px wide) and at the size drawn inside the UI
    paths = {a.path for a in tracker.client.list_artifacts(mlflow_run_id, "plots")}
    assert {METRICS, small(METRICS)} <= paths
    full = Path(tracker.client.download_artifacts(mlflow_run_id, METRICS, str(tmp_path)))
    assert full.read_bytes() == pics.metrics
    assert struct.unpack(">II", pics.metrics[16:24]) == (1000, 960)
    inline = Path(tracker.client.download_artifacts(mlflow_run_id, small(METRICS), str(tmp_path)))
    assert struct.unpack(">II", inline.read_bytes()[16:24]) == (576, 640)  # fits the UI's ~600 px value column
    # the MLflow link opens the run in MLflow's training view, not its GenAI one
    assert head["mlflow_run_id"].value.endswith(f"/runs/{mlflow_run_id}?{WORKFLOW_QUERY}")


def test_every_mlflow_page_link_is_made_by_the_tracker():
    """Links to MLflow pages (`/#/experiments/...`) are built only in factory/cockpit/tracking.py, whose `run_url` and
    `sweep_url` add WORKFLOW_QUERY (tests/cockpit/test_tracking.py): no other module spells such a URL."""
    spelled = [f"{p.relative_to(ROOT)}:{i}" for top in ("factory", "assets", "jobs", "resources")
               for p in sorted((ROOT / top).rglob("*.py")) if p != ROOT / "factory" / "cockpit" / "tracking.py"
               for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"#/experiments", line)]
    assert spelled == []
