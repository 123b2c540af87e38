"""What the browser tests share: getting Dagster's first-visit dialog out of the way."""


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
