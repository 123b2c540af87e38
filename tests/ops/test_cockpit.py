"""The cockpit's links (factory/ops/cockpit.py) against the Definitions they point into: every asset group opened
out, and the quickstart's graph in the lineage view (no Info panel beside it). The browser side, at 1600x1000, is in
tests/e2e/test_ui_live_sweep.py."""

from urllib.parse import parse_qs, unquote, urlsplit

from factory.ops.cockpit import GROUPS, QUICKSTART_GROUPS, cockpit_urls


def _groups(assets) -> set[str]:
    return {spec.group_name for a in assets for spec in a.specs}


def _expanded(url: str) -> set[str]:
    (expanded,) = parse_qs(urlsplit(url).query)["expanded"]
    assert all(g.startswith("global@global:") for g in expanded.split(","))
    return {g.removeprefix("global@global:") for g in expanded.split(",")}


def test_the_all_assets_link_opens_every_group_out():
    from jobs import ALL_ASSETS

    assert set(GROUPS) == _groups(ALL_ASSETS)  # `data` and `ops` were left folded
    assert _expanded(cockpit_urls()["lineage"]) == set(GROUPS)


def test_the_quickstart_link_is_the_lineage_of_the_jobs_assets_every_group_open():
    from jobs import QUICKSTART_ASSETS  # the quickstart job's selection

    url = cockpit_urls("http://127.0.0.1:3600")["quickstart"]
    path = unquote(urlsplit(url).path)
    # the lineage view filtered to the job's assets: the job's own page draws its Info panel over the graph
    assert path == '/asset-groups~job:"quickstart"/', path
    assert set(QUICKSTART_GROUPS) == _groups(QUICKSTART_ASSETS)  # `data` was left folded
    assert _expanded(url) == set(QUICKSTART_GROUPS)
