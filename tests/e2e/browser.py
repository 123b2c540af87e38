"""What the browser tests share: where chromium is, where screenshots go, skipping (or failing, under
FACTORY_REQUIRE_BROWSER=1) without a browser, getting Dagster's first-visit dialog out of the way, and finding what
a page shows only by scrolling sideways."""

import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parents[2] / "test-artifacts" / "e2e"


def require_browser() -> None:
    """Skip without playwright or chromium; fail instead where FACTORY_REQUIRE_BROWSER=1 (CI installs both)."""
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


def dismiss_newsletter(page) -> None:
    """The UI opens a first-visit newsletter dialog a few seconds after load, over the launchpad."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(state="visible", timeout=20_000)
    except PlaywrightTimeout:
        return  # this version or this visit shows none
    skip.click()
    skip.wait_for(state="hidden", timeout=10_000)


# The boxes around the metadata table's pictures and tables that scroll sideways (their content is wider than what
# they show: what is past the edge is out of view), as `class: scrollWidth > clientWidth`.
SCROLLED = """() => Array.from(document.querySelectorAll('td img, td table')).flatMap(e => {
  const out = [];
  for (let a = e.parentElement; a; a = a.parentElement)
    if (getComputedStyle(a).overflowX !== 'visible' && a.scrollWidth > a.clientWidth + 1)
      out.push(a.className.slice(0, 40) + ': ' + a.scrollWidth + ' > ' + a.clientWidth);
  return [...new Set(out)]; })"""
