"""Browser test: what a new user does after `make demo`: open the UI, launch a 2-member sweep from the launchpad.

Starts from what `make demo` leaves behind (`python -m jobs.demo`, tiny overrides, in a temp FACTORY_HOME: its
instance settings, a quickstart run, a recorded checkpoint), then the cockpit of `make ui` (dagster dev and the
MLflow UI, factory/ops/cockpit.py), and drives Debian's chromium with Playwright:

- the sweep launchpad opens with a working example (real axes, no unexplained resource config);
- a sweep with `max_concurrent: 1` over two learning rates (one shared SFT warm start) is launched with Launch Run;
- asserted from the run storage: never two of the sweep's runs at once, the warm start trained by one run
  (one materialization) before any member started, member runs tagged with their axis values, never two
  evals at once nor two summaries at once (a summary has its own queue: it may run beside an eval), the complete
  summary (no eval pending) started after every eval landed, the check
  of every evaluated checkpoint shown as evaluated;
- the quickstart graph opens expanded; the sweep summary and a member's pictures, its metric panel among them, are
  drawn in place (their images load from the MLflow UI). Screenshots of them go to test-artifacts/e2e/ on every
  run (`member_metric_panel.png`: the panel as the member's page draws it).

Skipped where chromium or playwright is missing, unless FACTORY_REQUIRE_BROWSER=1 (CI sets it: there, a
missing browser is a failure).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from factory.ops.cockpit import cockpit, cockpit_urls
from tests.e2e.browser import ARTIFACTS, CHROMIUM, SCROLLED, dismiss_newsletter, require_browser

ROOT = Path(__file__).parents[2]
TINY = ["model.preset=micro", "task.n_train=200", "task.n_eval=20", "sft.steps=10", "sft.stop_at_accuracy=null",
        "rollout.prompts_per_step=4", "algorithm.group_size=4", "schedule.steps=2", "schedule.eval_pass_k=2"]
SWEEP_YAML = "\n".join([
    "ops:", "  plan_and_queue_sweep:", "    config:", "      name: e2e",
    f"      base_spec: {ROOT / 'examples' / 'quickstart.yaml'}",
    "      overrides: [" + ", ".join(TINY) + "]",
    "      axes:", "        algorithm.lr: [1.0e-3, 3.0e-3]", "      max_concurrent: 1", ""])
RUNS_QUERY = """query($job: String!) { runsOrError(filter: {pipelineName: $job}) {
  ... on Runs { results { runId status startTime endTime tags { key value } } } } }"""
CHECK_QUERY = """{ assetNodes(assetKeys: [{path: ["checkpoint_eval"]}]) { assetChecksOrError { ... on AssetChecks {
  checks { name executionForLatestMaterialization { status } } } } } }"""
# The boxes around an element that clip its overflow and end left of its right edge (empty: drawn whole).
CLIPPED_BY = """e => { const right = e.getBoundingClientRect().right, out = [];
  for (let a = e.parentElement; a; a = a.parentElement) {
    if (getComputedStyle(a).overflowX !== 'visible' && right > a.getBoundingClientRect().right + 1)
      out.push(a.tagName + '.' + a.className); }
  return out; }"""
MATERIALIZATIONS = """query($key: [String!]!) { assetOrError(assetKey: {path: $key}) { ... on Asset {
  assetMaterializations(limit: 50) { runId partition timestamp } } } }"""


@pytest.fixture
def after_demo(tmp_path):
    """`make demo`'s state (its entry point, tiny settings) and `make ui`'s cockpit on it."""
    require_browser()
    home = tmp_path / "factory-home"
    env = dict(os.environ, FACTORY_HOME=str(home), DAGSTER_HOME=str(home / "dagster"))
    demo = subprocess.run([sys.executable, "-m", "jobs.demo", *[a for o in TINY for a in ("--set", o)]], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    try:
        with cockpit(home) as (dagster, mlflow):
            yield dagster.url, mlflow.url, dagster.log_path
    finally:
        from factory.home import factory_home
        from factory.runs.eval_server import stop_server

        stop_server(factory_home(home))  # the eval server the periodic evals started (it would idle on for minutes)


def gql(url: str, query: str, variables: dict | None = None) -> dict:
    r = httpx.post(f"{url}/graphql", json={"query": query, "variables": variables or {}}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]


def _runs(url: str, job: str) -> list[dict]:
    return gql(url, RUNS_QUERY, {"job": job})["runsOrError"]["results"]


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


def _wait_for_complete_summary(url: str, timeout_s: float) -> list[dict]:
    """The sweep's summary runs, once one drawn with no eval pending has succeeded (jobs/_summary.py)."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = _runs(url, "sweep_summary_job")
        assert not [r for r in runs if r["status"] in ("FAILURE", "CANCELED")], runs
        if any(r["status"] == "SUCCESS" and _tags(r).get("factory/evals_pending") == "0" for r in runs):
            return runs
        assert time.monotonic() < deadline, f"no complete summary in {timeout_s:.0f} s: {runs}"
        time.sleep(1.0)  # polling the server, bounded by the deadline


def _tags(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["tags"]}


def _never_overlap(runs: list[dict]) -> None:
    ordered = sorted(runs, key=lambda r: r["startTime"])
    for a, b in zip(ordered, ordered[1:], strict=False):
        assert a["endTime"] <= b["startTime"], f"runs overlapped: {a} and {b}"


def _images_loaded(page, mlflow_url: str, n: int) -> list[int]:
    """Widths of the page's images served by the MLflow UI, once `n` of them have loaded (bounded wait)."""
    page.wait_for_function(
        "([u, n]) => Array.from(document.images).filter(i => i.src.startsWith(u) && i.complete && "
        "i.naturalWidth > 0).length >= n", arg=[mlflow_url, n], timeout=60_000)
    return page.evaluate("u => Array.from(document.images).filter(i => i.src.startsWith(u)).map(i => i.naturalWidth)",
                         mlflow_url)


@pytest.mark.slow
def test_a_sweep_from_the_launchpad_after_make_demo(after_demo):
    from playwright.sync_api import expect, sync_playwright

    url, mlflow_url, log = after_demo
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(cockpit_urls(url)["sweep_launchpad"], timeout=120_000)
            page.wait_for_selector(".CodeMirror", timeout=120_000)
            dismiss_newsletter(page)
            # The launchpad opens with a sweep that would run as it stands.
            prefilled = page.evaluate("() => document.querySelector('.CodeMirror').CodeMirror.getValue()")
            assert "axes:" in prefilled and "algorithm.lr:" in prefilled, prefilled
            assert "root: ''" not in prefilled and "seed:" not in prefilled, prefilled
            page.get_by_text("No errors").wait_for(timeout=30_000)
            # The launchpad's editor is CodeMirror 5: set the text through its API (typing would auto-indent).
            page.evaluate("yaml => document.querySelector('.CodeMirror').CodeMirror.setValue(yaml)", SWEEP_YAML)
            page.get_by_text("No errors").wait_for(timeout=30_000)  # the launchpad validated the config
            launch = page.get_by_role("button", name="Launch Run")
            expect(launch).to_be_enabled(timeout=30_000)
            launch.click()
            page.wait_for_url("**/runs/**", timeout=60_000)

            (plan,) = _wait_for(url, "sweep", 1, timeout_s=180)
            members = _wait_for(url, "sweep_member_job", 2, timeout_s=600)
            (warm,) = _wait_for(url, "sweep_warm_start_job", 1, timeout_s=60)
            evals = _wait_for(url, "checkpoint_eval_job", 6, timeout_s=600)  # the demo's checkpoint + 2 members'
            summary = _wait_for_complete_summary(url, timeout_s=300)  # the first came as the members ended

            # 1. max_concurrent 1: the warm start, then one member after the other, never two at once.
            _never_overlap([warm, *members])
            assert warm["endTime"] <= min(m["startTime"] for m in members)
            # 2. one SFT warm start, materialized once, shared by both members.
            mats = gql(url, MATERIALIZATIONS, {"key": ["sweep_warm_start"]})["assetOrError"]["assetMaterializations"]
            assert [m["runId"] for m in mats] == [warm["runId"]]
            # 8. member runs carry their axis values.
            assert sorted(_tags(m)["axis/algorithm.lr"] for m in members) == ["0.001", "0.003"]
            # 12. progress reported on the run while it trained (its last report stays: the final step).
            assert all(_tags(m)["factory/progress"] == "grpo 2/2" and "factory/eta" in _tags(m) for m in members)
            # 3. evals one at a time (the eval limit), summaries one at a time (the summary limit; beside an eval is
            # fine); the complete summary started after every eval had landed (its materialization, ms since epoch).
            _never_overlap(evals)
            _never_overlap(summary)
            complete = [r for r in summary if _tags(r).get("factory/evals_pending") == "0"]
            landed = gql(url, MATERIALIZATIONS, {"key": ["checkpoint_eval"]})["assetOrError"]["assetMaterializations"]
            assert len(landed) >= len(evals)
            assert complete and complete[0]["startTime"] >= max(float(m["timestamp"]) / 1000 for m in landed)
            # 4. the regression check shows its latest execution, not "Not evaluated".
            (check,) = gql(url, CHECK_QUERY)["assetNodes"][0]["assetChecksOrError"]["checks"]
            assert check["executionForLatestMaterialization"]["status"] in ("SUCCEEDED", "FAILED")

            # 7. the quickstart's graph opens expanded: its assets are drawn, not folded into groups.
            page.goto(cockpit_urls(url)["quickstart"], timeout=60_000)
            # (folded, the graph shows only the group names; the nodes far right may be virtualized out of view)
            page.get_by_text("sft_checkpoint", exact=True).first.wait_for(timeout=60_000)
            expect(page.get_by_text("task_dataset", exact=True).first).to_be_visible()
            # 8. the runs list tells members apart.
            page.goto(f"{url}/runs", timeout=60_000)
            page.get_by_text("axis/algorithm.lr: 0.003").first.wait_for(timeout=60_000)

            # 9-11. the summary and a member's pictures, drawn in place from the MLflow UI.
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.set_viewport_size({"width": 1600, "height": 2600})  # the pages scroll inside; show them whole
            sweep_id = _tags(members[0])["factory/sweep_id"]
            page.goto(f"{url}/assets/sweep_summary?partition={sweep_id}", timeout=60_000)
            widths = _images_loaded(page, mlflow_url, 3)  # overlays per benchmark + accuracy vs lr
            assert all(w == 448 for w in widths), widths  # the inline size (plots.INLINE_DPI): within the column
            page.screenshot(path=str(ARTIFACTS / "sweep_summary.png"), full_page=True)
            # nothing of the summary out of view to the right: its links named the checkpoints by a tmp path that
            # does not wrap, and the box scrolled sideways (issue 32)
            assert page.evaluate(SCROLLED) == []
            page.goto(f"{url}/assets/sweep_member_run", timeout=60_000)
            assert _images_loaded(page, mlflow_url, 3)  # curves, held-out accuracy by step, the metric panel
            page.screenshot(path=str(ARTIFACTS / "member_evals_by_step.png"), full_page=True)
            # 13. every metric drawn: the member's metric panel (factory/cockpit/metric_panel.py) loaded in place.
            panel = page.locator("img[src*='plots%2Fmetrics.small.png']").first
            panel.scroll_into_view_if_needed()
            assert panel.evaluate("i => i.complete && i.naturalWidth") == 576  # metric_panel's inline copy
            # drawn whole: no box around it that clips its overflow ends left of its right edge (a 750 px copy was
            # cut off on the right by the metadata table)
            assert panel.evaluate(CLIPPED_BY) == [], "the metric panel is cut off on the right"
            panel.screenshot(path=str(ARTIFACTS / "member_metric_panel.png"))
        except BaseException:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "failure.png"), full_page=True)
            shutil.copy(log, ARTIFACTS / "dagster-dev.log")
            raise
        finally:
            browser.close()


def test_the_sweep_typed_into_the_launchpad_is_valid_and_plans_two_members_on_one_warm_start():
    """The browser test's input, checked in seconds without a browser or a run (that test is marked slow): the
    `sweep` job accepts it as run config, and it plans what the browser test then waits for."""
    import yaml
    from dagster import validate_run_config

    from factory.cockpit.sweep import SweepDefinition, plan_sweep
    from factory.config import parse_overrides
    from jobs import defs

    run_config = yaml.safe_load(SWEEP_YAML)
    validate_run_config(defs.get_job_def("sweep"), run_config)
    fields = run_config["ops"]["plan_and_queue_sweep"]["config"]
    plan = plan_sweep(SweepDefinition(**{**fields, "overrides": parse_overrides(fields["overrides"])}))
    assert [m.values for m in plan.members] == [{"algorithm.lr": 1.0e-3}, {"algorithm.lr": 3.0e-3}]
    assert len(plan.warm_starts()) == 1
