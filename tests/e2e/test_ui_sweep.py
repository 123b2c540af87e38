"""Browser test: the Dagster UI launches a 2-member sweep, and the run queue runs its members one at a time.

Starts `dagster dev` on 127.0.0.1 with a temp FACTORY_HOME and DAGSTER_HOME (the instance settings of
`factory.sweep.dagster_instance_yaml`: a run queue with one run per sweep lane), drives Debian's chromium
with Playwright to the sweep job's launchpad, enters the sweep's config, clicks Launch Run, and waits
(bounded) for the sweep run and both member runs to succeed. On failure a screenshot and the server log
are kept under test-artifacts/e2e/. Skipped where chromium or playwright is missing, unless
FACTORY_REQUIRE_BROWSER=1 (CI sets it: there, a missing browser is a failure).
"""

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from factory.ops.dagster_dev import dagster_dev

ROOT = Path(__file__).parents[2]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts" / "e2e"
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=2", "schedule.eval_pass_k=2"]
SWEEP_YAML = "\n".join([
    "ops:", "  plan_and_queue_sweep:", "    config:", "      name: e2e",
    f"      base_spec: {ROOT / 'examples' / 'quickstart.yaml'}",
    "      overrides: [" + ", ".join(TINY) + "]",
    "      axes:", "        seed: [0, 1]", "      max_concurrent: 1", ""])
RUNS_QUERY = """query($job: String!) { runsOrError(filter: {pipelineName: $job}) {
  ... on Runs { results { runId status startTime endTime tags { key value } } } } }"""


def _require_browser():
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing = "the playwright package"
    else:
        missing = None if Path(CHROMIUM).exists() else CHROMIUM
    if missing:
        if os.environ.get("FACTORY_REQUIRE_BROWSER") == "1":
            pytest.fail(f"browser test required but {missing} is not installed (.ci/run installs it)")
        pytest.skip(f"{missing} is not installed")


@pytest.fixture
def dagster_ui(tmp_path):
    _require_browser()
    with dagster_dev(tmp_path / "factory-home", max_concurrent_runs=4) as ui:
        yield ui.url, ui.log_path


def _runs(url: str, job: str) -> list[dict]:
    r = httpx.post(f"{url}/graphql", json={"query": RUNS_QUERY, "variables": {"job": job}}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["runsOrError"]["results"]


def _wait_for(url: str, job: str, n: int, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        runs = _runs(url, job)
        failed = [r for r in runs if r["status"] in ("FAILURE", "CANCELED")]
        assert not failed, f"{job} run(s) failed: {failed}"
        if len(runs) >= n and all(r["status"] == "SUCCESS" for r in runs):
            return runs
        assert time.monotonic() < deadline, f"{job}: {n} successful runs not seen in {timeout_s:.0f} s: {runs}"
        time.sleep(1.0)  # polling the server, bounded by the deadline


def _dismiss_newsletter(page) -> None:
    """The UI opens a first-visit newsletter dialog a few seconds after load, over the launchpad."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(state="visible", timeout=20_000)
    except PlaywrightTimeout:
        return  # this version or this visit shows none
    skip.click()
    skip.wait_for(state="hidden", timeout=10_000)


def test_launch_a_two_member_sweep_from_the_launchpad(dagster_ui):
    from playwright.sync_api import expect, sync_playwright

    url, log = dagster_ui
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        try:
            page.goto(f"{url}/locations/factory/jobs/sweep/playground", timeout=120_000)
            page.wait_for_selector(".CodeMirror", timeout=120_000)
            _dismiss_newsletter(page)
            # The launchpad's editor is CodeMirror 5: set the text through its API (typing would auto-indent).
            page.evaluate("yaml => document.querySelector('.CodeMirror').CodeMirror.setValue(yaml)", SWEEP_YAML)
            page.get_by_text("No errors").wait_for(timeout=30_000)  # the launchpad validated the config
            launch = page.get_by_role("button", name="Launch Run")
            expect(launch).to_be_enabled(timeout=30_000)
            launch.click()
            page.wait_for_url("**/runs/**", timeout=60_000)

            (plan,) = _wait_for(url, "sweep", 1, timeout_s=180)
            members = _wait_for(url, "sweep_member_job", 2, timeout_s=600)
            tags = [{t["key"]: t["value"] for t in r["tags"]} for r in members]
            assert {t["factory/sweep_id"] for t in tags} == {tags[0]["factory/sweep_id"]}
            assert len({t["factory/member"] for t in tags}) == 2 and len({t["factory/lane"] for t in tags}) == 1
            # max_concurrent 1: the queue ran one member after the other
            first, second = sorted(members, key=lambda r: r["startTime"])
            assert first["endTime"] <= second["startTime"], members
            page.goto(f"{url}/runs", timeout=60_000)
            page.get_by_text("sweep_member_job").first.wait_for(timeout=60_000)  # the UI lists them
        except BaseException:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
            shutil.copy(log, ARTIFACTS / "dagster-dev.log")
            raise
        finally:
            browser.close()
