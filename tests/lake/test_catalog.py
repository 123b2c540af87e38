"""Opening the catalog and creating its tables: processes starting together on a fresh home all succeed
and leave exactly one table of each name (no orphan metadata from a lost create)."""

from __future__ import annotations

import pytest

from factory.home import factory_home
from factory.lake import TABLES, Lake
from tests.racing import race

_OPEN = """
from factory.home import factory_home
from factory.lake import Lake
Lake.open(factory_home(root)).close()
"""


@pytest.mark.slow
def test_processes_opening_a_fresh_catalog_together_all_succeed(tmp_path):
    root = race(tmp_path, _OPEN, 6)
    paths = factory_home(root)
    with Lake.open(paths) as lake:
        assert {t[1] for t in lake.catalog.list_tables("factory")} == set(TABLES)
    for name in TABLES:  # one create won: a single metadata file per table
        assert len(list((paths.warehouse / "factory" / name / "metadata").glob("*.metadata.json"))) == 1, name
