"""Browser test: a running sweep's page in the cockpit of `make ui`, kept current by the daemon's `sweep_live` tick,
then its summary and the cockpit's other pages at 1600x1000.

A sweep of six members (three learning rates, two group sizes) is launched with the `sweep` job and paused, so
nothing trains; its members' state is written into the lake as the trainer writes it (one done, one training, one
resumed after a kill, one pruned, one failed, one queued). Then the cockpit (dagster dev with its daemon, and the
MLflow UI) starts, the daemon's tick records the observation, and chromium (Playwright) opens `sweep_summary` at the
sweep's partition in a 1600 px window: the members' curves (with the sampler/trainer gap's row: two members measured
it) are drawn in place from the MLflow UI, every member's status is listed by its axis values, and the picture and
the table fit the metadata table's value column (they were cut on the right).

Then, in a 1600x1000 window (issue 32): the sweep's summary, materialized, shows its members table and its overlay
pictures without a sideways scroll (a long axis name cut the pictures, the table put status, accuracy and intervals
out of view); the quickstart's link draws the graph with no Info panel over it; the all-assets link opens every group
out; a sensor's page says where a tick's skip reason is, and hovering the tick's "0 runs requested" shows it.
Screenshots go to test-artifacts/e2e/ on every run (live_sweep.png, summary_pictures.png, summary_members.png,
quickstart.png, all_assets.png, sensor_ticks.png).

Skipped where chromium or playwright is missing, unless FACTORY_REQUIRE_BROWSER=1.
"""

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.e2e.browser import ARTIFACTS, CHROMIUM, SCROLLED, dismiss_newsletter, require_browser
from tests.polling import wait_for

ROOT = Path(__file__).parents[2]
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=40", "schedule.eval_pass_k=2"]
# Each picture and table of the metadata table: its right edge, and the nearest right edge that cuts it (of an
# ancestor that clips its overflow, or the window).
FITS = """() => Array.from(document.querySelectorAll('td img, td table')).map(e => {
  let clip = window.innerWidth;
  for (let a = e.parentElement; a; a = a.parentElement) {
    if (getComputedStyle(a).overflowX !== 'visible') clip = Math.min(clip, a.getBoundingClientRect().right);
  }
  return [e.tagName, Math.round(e.getBoundingClientRect().right), Math.round(clip)];
})"""


def _partly_trained_sweep(instance, paths) -> str:
    """A paused sweep whose members' `sweeps`, `steps`, `evals` and `interruptions` rows say they are part way."""
    from dagster._daemon.types import DaemonHeartbeat
    from pyiceberg.expressions import EqualTo

    from factory.cockpit.sweep import read_sweep, set_control
    from factory.lake import Lake
    from jobs import defs

    instance.add_daemon_heartbeat(DaemonHeartbeat(time.time(), "SENSOR", None, []))  # the sweep job asks for one
    res = defs.resolve_job_def("sweep").execute_in_process(run_config={"ops": {"plan_and_queue_sweep": {"config": {
        "name": "live", "base_spec": str(ROOT / "examples" / "quickstart.yaml"), "overrides": TINY,
        "axes": {"algorithm.lr": [1e-3, 3e-4, 1e-2], "algorithm.group_size": [4, 8]}}}}}, instance=instance)
    sweep_id = res.output_for_node("plan_and_queue_sweep")["sweep_id"]
    set_control(paths, sweep_id, paused=True)  # nothing launches: the members' state is written below
    t0 = datetime.now(UTC) - timedelta(minutes=5)
    with Lake.open(paths) as lake:
        def member(i: int, **fields) -> None:
            key = read_sweep(paths, sweep_id)["members"][i]["key"]  # <sweep_id>-m00<i>-group_size=..._lr=...
            (row,) = lake.read("sweeps", EqualTo("member", key)).to_pylist()
            lake.upsert("sweeps", [dict(row, **fields, recorded_at=datetime.now(UTC))])

        def steps(run: str, numbers, attempt: int = 1, base: float = 0.1, gap: float | None = None) -> None:
            lake.upsert("steps", [dict(run_id=run, step=s, weight_version=s, reward_mean=min(1.0, base + 0.015 * s),
                                       attempt=attempt, recorded_at=t0 + timedelta(seconds=6 * s),
                                       **({} if gap is None else dict(gap_abs_mean=gap * (1 + s / 40),
                                                                      gap_kl=gap * gap * (1 + s / 20) / 2)))
                                  for s in numbers])

        def held_out(run: str, step: int, value: float) -> None:
            lake.upsert("evals", [dict(run_id=run, step=step, benchmark="arithmetic_heldout", metric="accuracy",
                                       value=value, n=500, recorded_at=t0)])

        member(0, status="succeeded", run_id="r0", final_accuracy=0.62)
        # its `runs` row: the summary links its checkpoint, a path under this test's long tmp directory
        lake.upsert("runs", [dict(run_id="r0", name="live", spec="{}", spec_fingerprint="f", code_version="c",
                                  status="succeeded", seed=0, started_at=t0, ended_at=t0 + timedelta(minutes=4),
                                  final_checkpoint=str(paths.checkpoints / "r0" / "final"))])
        steps("r0", range(1, 41), base=0.2, gap=0.02)  # r0 and r1 measured the sampler/trainer gap: its row drawn
        for s, v in ((10, 0.41), (20, 0.5), (30, 0.58), (40, 0.62)):
            held_out("r0", s, v)
        member(1, status="running", run_id="r1")
        steps("r1", range(1, 24), base=0.15, gap=0.01)
        held_out("r1", 10, 0.38)
        member(2, status="running", run_id="r2")
        steps("r2", range(1, 13))
        steps("r2", range(11, 19), attempt=2)
        lake.upsert("interruptions", [dict(run_id="r2", attempt=1, cause="killed", last_step=12, resumed_from_step=10,
                                           steps_lost=2, recorded_at=t0)])
        member(3, status="pruned", run_id="r3", reason="below the median of finished trials at step 10")
        steps("r3", range(1, 11), base=0.02)
        member(4, status="failed")
    return sweep_id


@pytest.mark.slow
def test_a_running_sweeps_page_shows_its_members_curves_and_statuses_within_the_page(tmp_path, monkeypatch):
    require_browser()
    from dagster import AssetKey, DagsterInstance
    from playwright.sync_api import sync_playwright

    from factory.home import factory_home
    from factory.ops.cockpit import cockpit, ensure_instance_yaml

    paths = factory_home(tmp_path / "factory-home")
    ensure_instance_yaml(paths.dagster_home)  # the instance settings `make ui` uses
    monkeypatch.setenv("FACTORY_HOME", str(paths.root))
    monkeypatch.setenv("DAGSTER_HOME", str(paths.dagster_home))
    with DagsterInstance.get() as instance:
        sweep_id = _partly_trained_sweep(instance, paths)
        with cockpit(paths.root) as (dagster, mlflow):
            wait_for("the daemon's sweep_live observation", lambda: instance.fetch_observations(
                AssetKey("sweep_summary"), limit=1).records, limit_s=300, every_s=1.0)
            with sync_playwright() as p:
                # with the scrollbars a desktop browser draws (Playwright hides them by default): 15 px less room
                browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"],
                                            ignore_default_args=["--hide-scrollbars"])
                page = browser.new_page(viewport={"width": 1600, "height": 1600})
                try:
                    page.goto(f"{dagster.url}/assets/sweep_summary?partition={sweep_id}", timeout=120_000)
                    page.get_by_text("members_table", exact=True).wait_for(timeout=120_000)
                    dismiss_newsletter(page)  # it would cover the curves in the screenshot
                    page.wait_for_function(  # the curves, served by the MLflow UI
                        "u => Array.from(document.images).some(i => i.src.startsWith(u) && i.complete && "
                        "i.naturalWidth > 0)", arg=mlflow.url, timeout=60_000)
                    ARTIFACTS.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(ARTIFACTS / "live_sweep.png"), full_page=True)
                    for status in ("done", "training", "resumed", "pruned", "failed", "queued"):
                        page.get_by_role("cell", name=status, exact=True).first.wait_for(timeout=10_000)
                    page.get_by_text("group_size=4, lr=3e-4", exact=True).wait_for(timeout=10_000)  # m002
                    page.get_by_text("resumed from step 10 after attempt 1 was killed").wait_for(timeout=10_000)
                    placed = page.evaluate(FITS)
                    assert {tag for tag, _, _ in placed} == {"IMG", "TABLE"}, placed
                    assert all(right <= clip for _, right, clip in placed), placed  # nothing cut on the right

                    monkeypatch.setenv("FACTORY_MLFLOW_UI", mlflow.url)  # the summary's pictures from this MLflow UI
                    page.set_viewport_size({"width": 1600, "height": 1000})
                    problems = _at_1600x1000(page, instance, dagster.url, mlflow.url, sweep_id)
                    assert problems == [], "\n".join(problems)
                finally:
                    browser.close()


def _at_1600x1000(page, instance, url: str, mlflow_url: str, sweep_id: str) -> list[str]:
    """Issue 32's cockpit checks in a 1600x1000 window, each a line in the list returned when it fails; screenshots of
    each page go to test-artifacts/e2e/."""
    from dagster import materialize

    from assets.sweeps import sweep_summary
    from factory.ops.cockpit import cockpit_urls
    from jobs import ALL_ASSETS, QUICKSTART_ASSETS, defs

    problems = []
    # The summary, materialized: its members table and overlay pictures within the value column, nothing sideways.
    assert materialize([sweep_summary], partition_key=sweep_id, instance=instance, resources=defs.resources).success
    page.goto(f"{url}/assets/sweep_summary?partition={sweep_id}", timeout=120_000)
    page.get_by_role("cell", name="pending_evals", exact=True).wait_for(timeout=120_000)  # the summary's metadata
    page.wait_for_function("([u, n]) => Array.from(document.images).filter(i => i.src.startsWith(u) && i.complete && "
                           "i.naturalWidth > 0).length >= n", arg=[mlflow_url, 3], timeout=60_000)
    page.get_by_text("members_on_heldout", exact=True).scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "summary_pictures.png"))
    placed = page.evaluate(FITS)
    if cut := [p for p in placed if p[1] > p[2]]:
        problems.append(f"summary: pictures or tables cut on the right ([tag, right, clip]): {cut}")
    if scrolled := page.evaluate(SCROLLED):
        problems.append(f"summary: the metadata table scrolls sideways: {sorted(set(scrolled))}")
    page.get_by_text("members_table", exact=True).scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "summary_members.png"))
    # m000's accuracy with its interval and n, and how far the pruned m003 got: in the table and within view
    for text in ("0.620 [0.577, 0.661] n=500", "succeeded, 40 steps, 4m00s", "pruned, 10 steps"):
        cell = page.get_by_role("cell", name=text, exact=True)
        box = cell.first.bounding_box() if cell.count() else None
        clip = cell.first.evaluate(CLIP) if box else None
        if box is None or box["x"] + box["width"] > min(clip, 1600):
            problems.append(f"summary: members table cell {text!r} not in the table or out of view: {box}, clip {clip}")

    # The quickstart's graph: the job's assets drawn, nothing beside them (the job page drew its Info panel).
    page.goto(cockpit_urls(url)["quickstart"], timeout=60_000)
    page.get_by_text("sft_checkpoint", exact=True).first.wait_for(timeout=60_000)
    page.wait_for_timeout(2_000)  # zoom-to-fit after the layout (no event marks its end; the checks below read it)
    page.screenshot(path=str(ARTIFACTS / "quickstart.png"))
    if page.get_by_text("Info", exact=True).count():
        problems.append("quickstart: an Info panel is drawn beside the graph")
    problems += [f"quickstart: {name} not drawn within the window" for name in _names(QUICKSTART_ASSETS)
                 if not _in_window(page, name)]

    # Every asset, every group opened out (folded, a group shows its name only).
    page.goto(cockpit_urls(url)["lineage"], timeout=60_000)
    page.get_by_text("sft_checkpoint", exact=True).first.wait_for(timeout=60_000)
    page.wait_for_timeout(2_000)
    page.screenshot(path=str(ARTIFACTS / "all_assets.png"))
    problems += [f"all assets: {name} not drawn (its group folded?)" for name in _names(ALL_ASSETS)
                 if not _in_window(page, name)]

    # A sensor's ticks: the page says where a skip reason is, and hovering a tick's tag shows it.
    page.goto(f"{url}/locations/factory/sensors/sweep_launcher", timeout=60_000)
    ticks = page.get_by_role("row").filter(has_text="View logs")
    ticks.nth(2).wait_for(timeout=60_000)
    if not page.get_by_text("hover its '0 runs requested' tag", exact=False).count():
        problems.append("sensor page: its description does not say where a tick's skip reason is")
    reason = page.get_by_text(f"sweep {sweep_id} paused", exact=True)
    for _ in range(3):  # the live list is redrawn every few seconds, which can take a tooltip away
        ticks.nth(1).get_by_text("0 runs requested", exact=True).first.hover()  # a finished tick's status tag
        try:
            reason.wait_for(timeout=5_000)
            break
        except Exception:  # noqa: BLE001 - tried again, then reported with the others
            page.mouse.move(0, 0)
    else:
        problems.append("sensor page: hovering a skipped tick's tag shows no reason")
    page.screenshot(path=str(ARTIFACTS / "sensor_ticks.png"))
    return problems


# The right edge of the nearest box around an element that clips its overflow (the window's without one).
CLIP = """e => { let clip = window.innerWidth;
  for (let a = e.parentElement; a; a = a.parentElement)
    if (getComputedStyle(a).overflowX !== 'visible') clip = Math.min(clip, a.getBoundingClientRect().right);
  return clip; }"""


def _names(assets) -> list[str]:
    return sorted({key.to_user_string() for a in assets for key in a.keys})


def _in_window(page, name: str) -> bool:
    """Whether an asset's node is drawn (its name, exactly) and lies within the 1600x1000 window."""
    node = page.get_by_text(name, exact=True)
    if not node.count():
        return False
    box = node.first.bounding_box()
    return box is not None and box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= 1600 \
        and box["y"] + box["height"] <= 1000

